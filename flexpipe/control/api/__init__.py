"""The controller's HTTP faces: its admin API and the dashboard's API (served), its client
(used by the CLI), its client of the gateway's admin API, and its Prometheus metrics."""
