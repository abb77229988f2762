"""One chat question to a running OpenAI-compatible server, its answer printed (what
`make run` shows first): ``python deploy/ask.py BASE_URL QUESTION``. Greedy, 48 tokens."""

import json
import sys
import urllib.request


def main(base_url: str, question: str) -> int:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 48, "temperature": 0}
    req = urllib.request.Request(base_url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.loads(r.read())["choices"][0]["message"]["content"]
    print(f"\nQ: {question}\nA: {answer.strip()}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
