"""Grammar-constrained decoding: compiled grammars and the step's token bitmasks (xgrammar)."""
