"""Text processing used by both processes: incremental detokenization, stop strings and
stop regexes, and grammars (regex / JSON schema / EBNF through xgrammar)."""
