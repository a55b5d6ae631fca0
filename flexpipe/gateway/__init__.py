"""The OpenAI-compatible gateway: routing, backpressure, retries, migration, tenants,
metrics and an admin API in front of any OpenAI-compatible engines (docs/gateway.md).

The server is `flexpipe.gateway.app.Gateway`, its configuration `flexpipe.gateway.config`;
the pure cores the simulator shares are in `flexpipe.gateway.core`. This package imports
nothing by itself, so that the simulator can import those cores without the server.
"""
