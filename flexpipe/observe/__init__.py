"""What flexpipe is doing, for people: one snapshot of the controller's status, the gateway's
metrics and every engine's metrics (`readings` fetches, `snapshot` reads them, purely), drawn by
`render` for `flexpipe status` and `flexpipe top`."""
