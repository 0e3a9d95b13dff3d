"""Small Qt helpers every room uses.

Icons drawn from SVG, colours and themes, shipped resources, display helpers, the elided label,
the destructive-action confirmation and the PySide compatibility shim. Imports no other room.
"""
