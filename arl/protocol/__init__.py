"""What crosses a process boundary and is shared by both sides (DESIGN §9): the import rule."""
