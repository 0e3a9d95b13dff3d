"""Chat pane: message model, rendering, input."""
