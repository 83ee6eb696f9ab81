"""polyrl.server."""
