"""The controller: the I/O shell that carries out the shift policy's decisions."""
