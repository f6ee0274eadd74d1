"""Measurements kept with the code: results/ (committed results files) and probes/ (finished investigations)."""
