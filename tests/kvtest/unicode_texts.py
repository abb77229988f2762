"""Strings that tokenizers and detokenizers get wrong first (frontend tests)."""

# Multi-byte unicode of every width (2, 3 and 4 bytes), combining marks, special
# tokens written out in text, and whitespace runs.
TEXTS = [
    "hello world",
    "The cache keeps every block it can.",
    "héllo wörld, ça va? naïve café",
    "世界 你好，日本語のテキスト",
    "emoji 🎉🚀 and a family 👨‍👩‍👧 flag 🇫🇷",
    "e\u0301 combining, Ωmega ∑ ∫ ≠ ≤",
    "  leading and trailing spaces  \n\ttabs\n\nnew lines",
    "<|user|>special tokens in text<|eos|> and <|bos|>",
    "",
]
