"""Offline analyses and planners over trace tables (see DESIGN.md §6)."""
