"""data/tasks."""
