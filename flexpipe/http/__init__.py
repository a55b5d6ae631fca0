"""HTTP plumbing shared by the sim engine and the gateway (see `flexpipe.http.server`)."""
