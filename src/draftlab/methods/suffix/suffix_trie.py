"""A depth-bounded suffix trie with occurrence counts: the index behind suffix decoding.

Every substring of length <= ``depth`` of the indexed sequences is a path from the root, and each node
counts how many times its substring occurred. So for a pattern (the trailing tokens of the context) the
children of its node, with their counts, are the empirical next-token distribution after that pattern in
everything indexed so far (``count(child) / count(node)``; the counts of a node's children sum to its own
count, less the occurrences that ended a sequence).

Appending a token extends the ``depth`` substrings that end at the previous token, so indexing costs
O(depth) dictionary steps per token, and a suffix of any substring is itself in the trie: the longest
pattern that matches can be found by growing it one token at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, Node] = {}
        self.count = 0


class SuffixTrie:
    """Substrings of length <= ``depth`` of the sequences appended to it, with counts."""

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"depth must be >= 2 (a pattern and a continuation), got {depth}")
        self.depth = depth
        self.root = Node()
        self._open: list[Node] = []  # nodes of the substrings ending at the last token, shortest first

    def start_sequence(self) -> None:
        """The next token starts a new sequence: no substring spans the boundary."""
        self._open = []

    def append(self, token: int) -> None:
        # Each open substring (length < depth) grows by the token; the token also starts a new one.
        grown = []
        for node in [self.root, *self._open[: self.depth - 1]]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
            child.count += 1
            grown.append(child)
        self._open = grown

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(int(t))

    def match(self, context: Sequence[int], max_pattern: int) -> tuple[Node | None, int]:
        """The node of the longest suffix of ``context`` (at most ``max_pattern`` tokens) that occurred with a
        continuation, and its length; ``(None, 0)`` when none did.

        "With a continuation" matters when the context itself is indexed: its own trailing pattern is in
        the trie, but only earlier occurrences say what follows it. If a pattern occurred earlier with a
        continuation, so did each of its suffixes, so growing the pattern stops at the first failure.
        """
        best, length = None, 0
        for m in range(1, min(max_pattern, self.depth - 1, len(context)) + 1):
            node = self.root
            for t in context[len(context) - m:]:
                node = node.children.get(t)
                if node is None:
                    return best, length
            if not node.children:
                return best, length
            best, length = node, m
        return best, length


def next_token_probs(node: Node) -> dict[int, tuple[float, Node]]:
    """``{token: (probability, child)}`` after ``node``'s substring, over the occurrences that continued."""
    total = sum(child.count for child in node.children.values())
    return {token: (child.count / total, child) for token, child in node.children.items()}
