"""Command-line tools and checks that sit above the trainer (memory estimator, digit eval, kernel checks)."""
