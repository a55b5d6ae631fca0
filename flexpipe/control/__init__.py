"""The controller: the I/O shell that keeps the running plan fitted to load and free GPUs."""
