"""Snapshots: manifest, memory file, device state, disk chain; verification."""
