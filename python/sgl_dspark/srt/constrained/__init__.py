"""Constrained decoding: grammars (JSON schema, regex, EBNF) compiled against the tokenizer's
vocabulary, and the per-request matchers that mask the logits of every step."""

from sgl_dspark.srt.constrained.grammar import GrammarBackend, GrammarMatcher, Grammars

__all__ = ["GrammarBackend", "GrammarMatcher", "Grammars"]
