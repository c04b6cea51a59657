"""Collectors: code that runs inside the traced process (see DESIGN.md §2)."""
