"""The ``polyrl`` command line. Nothing imports this package; it imports everything else lazily."""
