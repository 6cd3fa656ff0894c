"""The fixed prompts and text of the accuracy tools (fp8_kv_accuracy.py, quant_accuracy.py): greedy answers to
PROMPTS, MAX_NEW_TOKENS tokens each, and the per-token log-likelihood of TEXT, against the unquantized model; and
how two sets of answers agree (``agreement``)."""

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "How do I boil an egg?",
    "List three colours of the rainbow.",
    "Explain what a hash table is in two sentences.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
]
MAX_NEW_TOKENS = 64
TEXT = (
    "The cat sat on the windowsill and watched the rain fall over the quiet street. Every few minutes a car passed, "
    "its headlights sweeping across the wet pavement, and the cat followed each one with slow, patient eyes. In the "
    "kitchen behind it, the kettle began to whistle, and someone hummed an old song while they made the tea."
)


def agreement(answers: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of equal tokens position by position, mean share of each answer before its first differing token)."""
    equal = total = 0
    prefix = []
    for got, want in zip(answers, reference, strict=True):
        same = [a == b for a, b in zip(got, want, strict=True)]
        equal += sum(same)
        total += len(same)
        prefix.append((same.index(False) if False in same else len(same)) / len(same))
    return equal / total, sum(prefix) / len(prefix)
