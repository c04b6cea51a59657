"""HTML rendering of analysis results (see DESIGN.md §2)."""
