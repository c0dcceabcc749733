"""atlasc.passes: Program -> Program transformations, one pass per file (see atlasc/pipeline.py)."""
