"""The sandbox domain: lifecycle, registry on disk, the per-sandbox supervisor."""
