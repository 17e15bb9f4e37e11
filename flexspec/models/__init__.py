"""Model families: wiring of TP-aware layers. See ``registry`` for the architecture -> class table."""
