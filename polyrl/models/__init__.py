"""polyrl.models."""
