"""polyrl.infer."""
