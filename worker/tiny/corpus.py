"""The built-in corpus the tiny checkpoint's BPE tokenizer is trained on (no download:
it is this text). Plain English about what kvpool does, a little code and numbers, so
the merges cover words, spaces, punctuation and digits."""

CORPUS = """\
The scheduler owns every block of KV memory as a number; the worker owns the memory itself.
A block holds the keys and values of sixteen tokens. Block 0 is the null block.
When a block is full it gets a hash: the hash of its parent, its tokens and extra keys.
Requests that share a prompt prefix share its blocks, and the prefix cache finds them.
The free queue keeps blocks in eviction order: least recently used first, deepest last.
Out of blocks, the scheduler preempts the last running request and recomputes it later.
Rows are append-only. Steps are ordered. Full blocks are read-only. The worker derives what it can.
slot = block_id * block_size + position % block_size
def allocate_slots(request, num_new_tokens): return blocks or None
for layer in range(num_layers): k, v = attention(layer, q, k, v)
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Hello, world! How are you today? I am fine, thank you. What is the weather like?
User: summarise the document in three sentences. Assistant: Here is a short summary.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 65536 3.14 2.71
Time to first token, time per output token, inter-token latency and throughput in tokens per second.
A language model predicts the next token from the tokens before it, one step at a time.
Attention reads the keys and values of every earlier token; the cache keeps them so nothing is recomputed.
Greedy decoding takes the most likely token; sampling draws from the distribution with a temperature.
Top-k keeps the k most likely tokens, top-p the smallest set whose probability reaches p, min-p drops the unlikely.
Penalties for presence, frequency and repetition discourage the model from saying the same thing again.
"""
