"""Checks a running `moeflux serve` with the official `openai` Python client.

    python tools/openai_client_check.py --base-url http://127.0.0.1:8080/v1 \
        --api-key KEY --model qwen35-tiny

Exits non-zero, naming the check, when the server answers something the
client cannot read or that breaks OpenAI's contract. The Rust test
crates/moeflux-server/tests/openai_python.rs runs it in the virtual
environment tools/openai-venv.sh makes.
"""

import argparse
import json
import sys

import openai


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = args.model
    messages = [{"role": "user", "content": "Who is Mr. Darcy?"}]

    models = client.models.list()
    check([m.id for m in models.data] == [model], f"models: {models}")

    # A whole answer, greedy, with log-probabilities.
    answer = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = answer.choices[0]
    check(choice.message.role == "assistant", f"role: {choice.message}")
    check(choice.finish_reason in ("stop", "length"), f"finish_reason: {choice.finish_reason}")
    check(answer.usage.completion_tokens == len(choice.logprobs.content), f"usage: {answer.usage}")
    check(all(len(t.top_logprobs) == 2 for t in choice.logprobs.content), "top_logprobs")
    check(answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens, "usage sum")

    # The same answer streamed, with usage at the end.
    text, reasoning, usage, finish = "", "", None, None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            finish = c.finish_reason or finish
    check(text == (choice.message.content or ""), f"streamed {text!r} != {choice.message.content!r}")
    check(usage is not None and usage.completion_tokens == answer.usage.completion_tokens, f"stream usage: {usage}")
    check(finish == choice.finish_reason, f"stream finish: {finish}")

    # n choices, seeded sampling, a stop string.
    many = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, n=3, seed=7, temperature=0.9, stop=["\n\n"]
    )
    check(sorted(c.index for c in many.choices) == [0, 1, 2], f"n=3: {many.choices}")
    again = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, n=3, seed=7, temperature=0.9, stop=["\n\n"]
    )
    check([c.message.content for c in many.choices] == [c.message.content for c in again.choices], "seeded n=3 repeats")

    # Plain completions, whole and streamed.
    completion = client.completions.create(
        model=model, prompt="It is a truth universally acknowledged,", max_tokens=8, temperature=0, logprobs=2
    )
    check(len(completion.choices[0].logprobs.token_logprobs) == completion.usage.completion_tokens, "completion logprobs")
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="It is a truth universally acknowledged,", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    check(streamed == completion.choices[0].text, f"streamed completion {streamed!r}")

    # Structured output: the answer parses and fits the schema.
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "daughters": {"type": "integer", "maximum": 9}},
        "required": ["name", "daughters"],
        "additionalProperties": False,
    }
    structured = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe Mr. Bennet."}], max_tokens=100, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    person = json.loads(structured.choices[0].message.content)
    check(set(person) == {"name", "daughters"} and isinstance(person["daughters"], int), f"json_schema: {person}")

    # A forced tool call, whole and streamed: the client's tool_calls objects.
    tools = [{
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"town": {"type": "string", "maxLength": 10}},
                           "required": ["town"], "additionalProperties": False},
        },
    }]
    request = {"model": model, "messages": [{"role": "user", "content": "Rain in Bath?"}], "tools": tools,
               "tool_choice": "required", "max_tokens": 60, "seed": 2}
    called = client.chat.completions.create(**request)
    call = called.choices[0].message.tool_calls[0]
    check(called.choices[0].finish_reason == "tool_calls", f"finish: {called.choices[0]}")
    check(call.type == "function" and call.function.name == "weather", f"call: {call}")
    check(isinstance(json.loads(call.function.arguments)["town"], str), f"arguments: {call.function.arguments}")
    streamed_calls = [
        t for chunk in client.chat.completions.create(**request, stream=True)
        for c in chunk.choices for t in (c.delta.tool_calls or [])
    ]
    check(len(streamed_calls) == 1 and streamed_calls[0].function.arguments == call.function.arguments,
          f"streamed calls: {streamed_calls}")

    # Errors come back as the client's exception types.
    for kwargs, error in [
        ({"temperature": 5}, openai.BadRequestError),
        ({"model": "gpt-4o"}, openai.NotFoundError),
        ({"messages": []}, openai.BadRequestError),
        ({"max_tokens": 10**6}, openai.BadRequestError),
    ]:
        request = {"model": model, "messages": messages, "max_tokens": 4, **kwargs}
        try:
            client.chat.completions.create(**request)
        except error as e:
            check(e.body and e.body.get("message"), f"{kwargs}: no message in {e.body}")
        else:
            raise AssertionError(f"{kwargs}: no {error.__name__}")
    wrong_key = openai.OpenAI(base_url=args.base_url, api_key="wrong", max_retries=0)
    try:
        wrong_key.models.list()
    except openai.AuthenticationError:
        pass
    else:
        raise AssertionError("a wrong API key was accepted")
    print("openai client: models, chat, streaming, usage, logprobs, n, seed, stop, completions, "
          "json_schema, tool calls (whole and streamed), errors: ok")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"check failed: {e}", file=sys.stderr)
        sys.exit(1)
