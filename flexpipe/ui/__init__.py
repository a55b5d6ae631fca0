"""The web dashboard's pure parts (docs/dashboard.md): a reading of the gateway
(`reading`), the 15-minute series (`series`) and the view the page shows (`view`). The page
itself is in `static/`; the gateway serves it (flexpipe/gateway/ui_routes.py)."""
