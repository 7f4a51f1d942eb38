"""The lowest layer: configuration, formulas, layouts, the reference, stage names, the machine."""
