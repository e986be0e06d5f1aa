"""Drives a running `ddtree serve` with the official `openai` Python client (pinned in
requirements-serve.txt): models, completions, chat completions, streaming and errors. Greedy
outputs must equal `ddtree generate` on the same prompt, token for token.

    python3 scripts/openai_client_check.py --base-url http://127.0.0.1:8000 --ddtree target/debug/ddtree

Exits 0 and prints `openai client check: ok`, or raises on the first mismatch.
"""

import argparse
import json
import subprocess

import openai


def generate(ddtree, prompt, max_tokens):
    """Tokens and text of `ddtree generate` (the built-in pair, DDTree, greedy) on the CPU."""
    out = subprocess.run(
        [ddtree, "generate", "--device", "cpu", "--prompt", prompt, "--max-tokens", str(max_tokens), "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    report = json.loads(out)
    return report["tokens"], report["text"]


def expect_error(cls, param, call):
    try:
        call()
    except cls as e:
        body = e.body or {}
        assert body.get("param") == param, (cls.__name__, body)
        return e
    raise AssertionError(f"expected {cls.__name__} naming {param!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--ddtree", required=True, help="the ddtree binary, for `ddtree generate`")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url + "/v1", api_key="unused", max_retries=0)

    models = client.models.list()
    model = models.data[0].id
    assert model == "tiny-code", model

    # Completions: greedy tokens equal `ddtree generate`.
    prompt = "fn main() {"
    tokens, text = generate(args.ddtree, prompt, 24)
    c = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
    ext = c.model_extra["ddtree"]
    assert ext["completion_token_ids"] == tokens, (ext["completion_token_ids"], tokens)
    assert c.choices[0].text == text.replace("<|eos|>", ""), (c.choices[0].text, text)
    assert c.usage.completion_tokens == len(tokens)
    assert ext["rounds"] >= 1 and ext["mean_accepted_length"] >= 1.0, ext

    # Streaming gives the same text, in fewer chunks than tokens (DDTree rounds commit groups).
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=24, stream=True))
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert streamed == c.choices[0].text, (streamed, c.choices[0].text)
    assert chunks[-1].choices[0].finish_reason == c.choices[0].finish_reason
    assert len(chunks) < len(tokens) + 1, (len(chunks), len(tokens))

    # Chat: the built-in template concatenates the message contents.
    user = "def add(a, b):"
    tokens, text = generate(args.ddtree, user, 16)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": user}], max_tokens=16)
    assert r.model_extra["ddtree"]["completion_token_ids"] == tokens, (r.model_extra["ddtree"], tokens)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text.replace("<|eos|>", "")
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": user}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
        if ch.usage:
            usage = ch.usage
    assert "".join(parts) == r.choices[0].message.content
    assert usage is not None and usage.completion_tokens == len(tokens), usage

    # Errors reach the client as its exception types, naming the field.
    expect_error(openai.NotFoundError, "model", lambda: client.completions.create(model="gpt-x", prompt="a"))
    expect_error(openai.BadRequestError, "n", lambda: client.completions.create(model=model, prompt="a", n=2))
    expect_error(
        openai.BadRequestError,
        "max_tokens",
        lambda: client.completions.create(model=model, prompt="a", max_tokens=1_000_000),
    )
    expect_error(
        openai.BadRequestError,
        "logprobs",
        lambda: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "a"}], logprobs=True
        ),
    )
    expect_error(openai.BadRequestError, "prompt", lambda: client.completions.create(model=model, prompt=""))
    print("openai client check: ok")


if __name__ == "__main__":
    main()
