"""Where GPU changes come from: the watched cluster file, NVML discovery, Ray's inventory,
each turned into the controller's resource events; and the poller they share."""
