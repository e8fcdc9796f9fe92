// The OpenAI API contract as the official openai npm client sees it, against a turboquant-serve this file
// starts itself (with an API key, on 127.0.0.1 and a free port) and stops at the end.
//
//   TQ_SERVE_BIN=build/bin/turboquant-serve node --test tests/serve/conformance.test.mjs
//
// Where the client hides the wire (what comes after [DONE], the exact events), the test reads the raw
// stream with fetch. Every request has a time limit and the client never retries, so a failure shows.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { startServer, CHAT_TEMPLATE } from './server.mjs';

const API_KEY = 'conformance-test-key';
const REQUEST_MS = 60_000;
const T = { timeout: 120_000 };  // per test: a few requests at most

let server, client, model;

before(async () => {
  // The demo model has no chat template of its own: a plain transcript one comes with the tests.
  server = await startServer(['--api-key', API_KEY, '--parallel', '4', '--chat-template', CHAT_TEMPLATE]);
  client = new OpenAI({ baseURL: server.url + '/v1', apiKey: API_KEY, maxRetries: 0, timeout: REQUEST_MS });
  const models = await client.models.list();
  model = models.data[0]?.id;
});

after(async () => {
  await server?.stop();
});

const chatMessages = [
  { role: 'system', content: 'You are a storyteller.' },
  { role: 'user', content: 'Tell me a story about a cat.' },
];
const completionPrompt = 'Once upon a time, there was a little girl named Lily. One day,';

// POSTs body to path and reads the whole event stream: the data of each event in order, and whatever came
// after the [DONE] event (which must be nothing).
async function rawStream(path, body, { key = API_KEY } = {}) {
  const res = await fetch(server.url + path, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${key}` },
    body: JSON.stringify(body),
    signal: AbortSignal.timeout(REQUEST_MS),
  });
  const text = await res.text();
  assert.equal(res.status, 200, `${path}: ${text.slice(0, 500)}`);
  assert.match(res.headers.get('content-type') || '', /^text\/event-stream/);
  const events = [];
  let afterDone = null;
  // Events end with a blank line; each line of an event here is "data: ...".
  const blocks = text.replace(/\r\n/g, '\n').split('\n\n');
  for (let i = 0; i < blocks.length; i++) {
    const block = blocks[i];
    if (afterDone !== null) { afterDone += block; continue; }
    if (block.trim() === '') continue;
    const data = block.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).replace(/^ /, '')).join('\n');
    if (data === '[DONE]') { afterDone = ''; continue; }
    events.push(JSON.parse(data));
  }
  return { events, afterDone };
}

async function tokenize(content) {
  const res = await fetch(server.url + '/tokenize', {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${API_KEY}` },
    body: JSON.stringify({ content }),
    signal: AbortSignal.timeout(REQUEST_MS),
  });
  assert.equal(res.status, 200);
  return (await res.json()).tokens;
}

function checkUsage(usage, { completion } = {}) {
  assert.ok(usage, 'usage present');
  assert.ok(Number.isInteger(usage.prompt_tokens) && usage.prompt_tokens > 0, 'prompt_tokens > 0');
  assert.ok(Number.isInteger(usage.completion_tokens) && usage.completion_tokens >= 0);
  assert.equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens, 'total = prompt + completion');
  if (completion !== undefined) assert.equal(usage.completion_tokens, completion);
}

// ---------- models, keys, refusals ----------

test('/v1/models lists the served model', T, async () => {
  const models = await client.models.list();
  assert.ok(models.data.length >= 1);
  for (const m of models.data) {
    assert.equal(m.object, 'model');
    assert.equal(typeof m.id, 'string');
    assert.ok(m.id.length > 0);
  }
  const props = await (await fetch(server.url + '/props', { headers: { Authorization: `Bearer ${API_KEY}` } })).json();
  assert.ok(models.data.some((m) => m.id === props.model), `/v1/models names /props' model ${props.model}`);
});

test('a wrong or missing API key is refused with 401 and an OpenAI-shaped error; /health stays public', T, async () => {
  for (const apiKey of ['wrong-key', '']) {
    const bad = new OpenAI({ baseURL: server.url + '/v1', apiKey: apiKey || 'x', maxRetries: 0, timeout: REQUEST_MS,
      // An empty key: drop the header altogether, as a client without one would.
      defaultHeaders: apiKey ? {} : { Authorization: null } });
    await assert.rejects(
      bad.chat.completions.create({ model, messages: chatMessages, max_tokens: 4 }),
      (err) => {
        assert.ok(err instanceof OpenAI.AuthenticationError, `AuthenticationError, got ${err.constructor.name}: ${err.message}`);
        assert.equal(err.status, 401);
        assert.equal(typeof err.error?.message, 'string', 'error.message');
        assert.ok(err.error.message.length > 0);
        assert.equal(typeof err.error?.type, 'string', 'error.type');
        return true;
      },
    );
    await assert.rejects(bad.models.list(), (err) => err.status === 401);
  }
  const health = await fetch(server.url + '/health', { signal: AbortSignal.timeout(REQUEST_MS) });
  assert.equal(health.status, 200);
  assert.equal((await health.json()).status, 'ok');
});

test('n: 2 is refused with 400 and an OpenAI-shaped error', T, async () => {
  await assert.rejects(
    client.chat.completions.create({ model, messages: chatMessages, max_tokens: 4, n: 2 }),
    (err) => {
      assert.ok(err instanceof OpenAI.BadRequestError, `BadRequestError, got ${err.constructor.name}: ${err.message}`);
      assert.equal(err.status, 400);
      assert.equal(typeof err.error?.message, 'string');
      assert.match(err.error.message, /\bn\b/, 'the message names n');
      return true;
    },
  );
  await assert.rejects(
    client.completions.create({ model, prompt: completionPrompt, max_tokens: 4, n: 2 }),
    (err) => err.status === 400,
  );
});

test('a bad parameter is a 400 with message, type and code, also when streaming is asked', T, async () => {
  for (const stream of [false, true]) {
    await assert.rejects(
      client.chat.completions.create({ model, messages: chatMessages, max_tokens: 4, temperature: 5, stream }),
      (err) => {
        assert.ok(err instanceof OpenAI.BadRequestError, `BadRequestError, got ${err.constructor.name}: ${err.message}`);
        assert.equal(typeof err.error?.message, 'string');
        assert.match(err.error.message, /temperature/, 'the message names the parameter');
        assert.equal(err.error.type, 'invalid_request_error');
        assert.ok('code' in err.error, 'error.code present');
        return true;
      },
    );
  }
  // Unknown fields are ignored, as OpenAI's API does for fields it does not know.
  const res = await client.chat.completions.create({ model, messages: chatMessages, max_tokens: 2, some_future_field: { a: 1 } });
  assert.equal(res.choices.length, 1);
});

// ---------- non-streaming ----------

test('chat completion: an assistant message, finish_reason length at max_tokens, exact usage', T, async () => {
  const res = await client.chat.completions.create({ model, messages: chatMessages, max_tokens: 12, temperature: 0 });
  assert.equal(res.object, 'chat.completion');
  assert.equal(typeof res.id, 'string');
  assert.ok(Number.isInteger(res.created));
  assert.equal(res.choices.length, 1);
  const c = res.choices[0];
  assert.equal(c.index, 0);
  assert.equal(c.message.role, 'assistant');
  assert.equal(typeof c.message.content, 'string');
  assert.ok(c.message.content.length > 0);
  assert.equal(c.finish_reason, 'length', `12 tokens end at max_tokens (got ${c.finish_reason}: ${JSON.stringify(c.message.content)})`);
  checkUsage(res.usage, { completion: 12 });

  // max_completion_tokens is the newer name of the same limit.
  const res2 = await client.chat.completions.create({ model, messages: chatMessages, max_completion_tokens: 5, temperature: 0 });
  assert.equal(res2.choices[0].finish_reason, 'length');
  checkUsage(res2.usage, { completion: 5 });
  assert.equal(res2.usage.prompt_tokens, res.usage.prompt_tokens, 'the same messages count the same prompt tokens');
  assert.ok(res.choices[0].message.content.startsWith(res2.choices[0].message.content), 'greedy: 5 tokens are a prefix of 12');

  // A longer conversation counts more prompt tokens.
  const longer = [...chatMessages, { role: 'assistant', content: res.choices[0].message.content }, { role: 'user', content: 'Go on.' }];
  const res3 = await client.chat.completions.create({ model, messages: longer, max_tokens: 2, temperature: 0 });
  assert.ok(res3.usage.prompt_tokens > res.usage.prompt_tokens);
});

test('completion: text, finish_reason length, usage with prompt_tokens from /tokenize', T, async () => {
  const res = await client.completions.create({ model, prompt: completionPrompt, max_tokens: 10, temperature: 0 });
  assert.equal(res.object, 'text_completion');
  assert.equal(typeof res.id, 'string');
  assert.equal(res.choices.length, 1);
  assert.equal(typeof res.choices[0].text, 'string');
  assert.equal(res.choices[0].finish_reason, 'length');
  checkUsage(res.usage, { completion: 10 });
  const tokens = await tokenize(completionPrompt);
  assert.equal(res.usage.prompt_tokens, tokens.length, `prompt_tokens is the /tokenize count of the prompt (${tokens.length})`);
});

test('/tokenize and /detokenize round-trip', T, async () => {
  const tokens = await tokenize(completionPrompt);
  assert.ok(tokens.length > 0 && tokens.every(Number.isInteger));
  const res = await fetch(server.url + '/detokenize', {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${API_KEY}` },
    body: JSON.stringify({ tokens }),
    signal: AbortSignal.timeout(REQUEST_MS),
  });
  assert.equal(res.status, 200);
  assert.equal((await res.json()).content.trim(), completionPrompt);
});

// ---------- streaming ----------

test('chat stream: one id, the role in the first delta only, finish_reason in the last, usage chunk, nothing after [DONE]', T, async () => {
  const maxTokens = 16;
  const { events, afterDone } = await rawStream('/v1/chat/completions', {
    model, messages: chatMessages, max_tokens: maxTokens, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  assert.equal(afterDone, '', 'the stream ends with [DONE] and nothing after it');
  assert.ok(events.length >= 3, `role, content and usage chunks (got ${events.length})`);
  const ids = new Set(events.map((e) => e.id));
  assert.equal(ids.size, 1, 'one id across the chunks');
  for (const e of events) assert.equal(e.object, 'chat.completion.chunk');

  const usageChunk = events[events.length - 1];
  assert.deepEqual(usageChunk.choices, [], 'the usage chunk has empty choices');
  const choiceChunks = events.slice(0, -1);
  for (const e of choiceChunks) {
    assert.equal(e.choices.length, 1);
    assert.ok(e.usage === undefined || e.usage === null, 'usage only in the last chunk');
  }
  const deltas = choiceChunks.map((e) => e.choices[0].delta);
  assert.equal(deltas[0].role, 'assistant', 'the role is in the first delta');
  for (const d of deltas.slice(1)) assert.ok(d.role === undefined || d.role === null, 'the role is in the first delta only');
  const finishes = choiceChunks.map((e) => e.choices[0].finish_reason);
  assert.equal(finishes[finishes.length - 1], 'length', 'finish_reason in the last choice chunk');
  for (const f of finishes.slice(0, -1)) assert.equal(f, null, 'finish_reason is null before the last chunk');

  const text = deltas.map((d) => d.content || '').join('');
  checkUsage(usageChunk.usage, { completion: maxTokens });

  // The same request without streaming gives the same text and usage (greedy).
  const whole = await client.chat.completions.create({ model, messages: chatMessages, max_tokens: maxTokens, temperature: 0 });
  assert.equal(text, whole.choices[0].message.content, 'streamed text equals the non-streamed text');
  assert.deepEqual(usageChunk.usage.prompt_tokens, whole.usage.prompt_tokens);
});

test('chat stream through the client: content deltas, and no usage chunk unless asked', T, async () => {
  const stream = await client.chat.completions.create({ model, messages: chatMessages, max_tokens: 8, temperature: 0, stream: true });
  let text = '', last = null, chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    assert.equal(chunk.choices.length, 1, 'no usage chunk (empty choices) without stream_options.include_usage');
    assert.ok(!chunk.usage, 'no usage without stream_options.include_usage');
    text += chunk.choices[0].delta.content || '';
    last = chunk.choices[0].finish_reason;
  }
  assert.ok(chunks >= 2);
  assert.ok(text.length > 0);
  assert.equal(last, 'length');
});

// A chunk may carry several tokens: the server sends what has queued since its last write (seen: 12
// tokens in 3 to 13 chunks). So tokens are counted by their logprobs entries, one per token.
test('completion stream: completion_tokens = the tokens streamed, at least one per chunk, finish_reason last', T, async () => {
  const maxTokens = 12;
  const { events, afterDone } = await rawStream('/v1/completions', {
    model, prompt: completionPrompt, max_tokens: maxTokens, temperature: 0, stream: true, logprobs: 1,
    stream_options: { include_usage: true },
  });
  assert.equal(afterDone, '');
  assert.equal(new Set(events.map((e) => e.id)).size, 1, 'one id');
  for (const e of events) assert.equal(e.object, 'text_completion');
  const usageChunk = events[events.length - 1];
  assert.deepEqual(usageChunk.choices, []);
  checkUsage(usageChunk.usage, { completion: maxTokens });
  const choiceChunks = events.slice(0, -1);
  const streamedTokens = choiceChunks.flatMap((e) => e.choices[0].logprobs?.tokens ?? []);
  assert.equal(streamedTokens.length, usageChunk.usage.completion_tokens, 'completion_tokens equals the tokens streamed');
  const text = choiceChunks.map((e) => e.choices[0].text || '').join('');
  assert.equal(streamedTokens.join(''), text, 'the streamed tokens spell the streamed text');
  const textChunks = choiceChunks.filter((e) => e.choices[0].text);
  assert.ok(textChunks.length <= maxTokens, `no more text chunks (${textChunks.length}) than tokens`);
  const finishes = choiceChunks.map((e) => e.choices[0].finish_reason);
  assert.equal(finishes.at(-1), 'length');
  for (const f of finishes.slice(0, -1)) assert.equal(f ?? null, null);

  // Without logprobs: the same text, and never more text chunks than completion tokens.
  const plain = await rawStream('/v1/completions', {
    model, prompt: completionPrompt, max_tokens: maxTokens, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  const plainChunks = plain.events.filter((e) => e.choices.length);
  assert.equal(plainChunks.map((e) => e.choices[0].text || '').join(''), text);
  assert.ok(plainChunks.filter((e) => e.choices[0].text).length <= plain.events.at(-1).usage.completion_tokens);

  const whole = await client.completions.create({ model, prompt: completionPrompt, max_tokens: maxTokens, temperature: 0 });
  assert.equal(text, whole.choices[0].text, 'streamed text equals the non-streamed text');
  assert.equal(usageChunk.usage.prompt_tokens, whole.usage.prompt_tokens);
});

// ---------- stop strings ----------

// Picks a stop string from inside a greedy answer: a few characters from its middle, whose first
// occurrence is past the start (so that some text comes before it).
function pickStop(text) {
  for (let start = Math.floor(text.length / 3); start < text.length - 3; start++) {
    const s = text.slice(start, start + 3);
    if (s.trim().length < 2) continue;
    const first = text.indexOf(s);
    if (first > 0) return { stop: s, before: text.slice(0, first) };
  }
  return null;
}

test('stop strings: the text ends before the stop string, which never appears; finish_reason stop', T, async () => {
  const free = await client.completions.create({ model, prompt: completionPrompt, max_tokens: 40, temperature: 0 });
  const picked = pickStop(free.choices[0].text);
  assert.ok(picked, `a stop string can be picked from ${JSON.stringify(free.choices[0].text)}`);

  // As a string, non-streaming.
  const res = await client.completions.create({ model, prompt: completionPrompt, max_tokens: 40, temperature: 0, stop: picked.stop });
  assert.equal(res.choices[0].finish_reason, 'stop');
  assert.ok(!res.choices[0].text.includes(picked.stop), 'the stop string is not in the text');
  assert.equal(res.choices[0].text, picked.before, 'the text is everything before the stop string');
  assert.ok(res.usage.completion_tokens < 40);

  // In a list, streaming: the stop string may arrive split across tokens, and still never shows.
  const { events } = await rawStream('/v1/completions', {
    model, prompt: completionPrompt, max_tokens: 40, temperature: 0, stream: true, stop: ['\u0000never', picked.stop],
  });
  const streamed = events.filter((e) => e.choices.length).map((e) => e.choices[0].text || '').join('');
  assert.equal(streamed, picked.before);
  assert.equal(events.filter((e) => e.choices.length).at(-1).choices[0].finish_reason, 'stop');

  // Chat, streaming through the client.
  const chatFree = await client.chat.completions.create({ model, messages: chatMessages, max_tokens: 40, temperature: 0 });
  const chatPick = pickStop(chatFree.choices[0].message.content);
  assert.ok(chatPick, `a stop string can be picked from ${JSON.stringify(chatFree.choices[0].message.content)}`);
  const stream = await client.chat.completions.create({
    model, messages: chatMessages, max_tokens: 40, temperature: 0, stream: true, stop: [chatPick.stop],
  });
  let text = '', finish = null;
  for await (const chunk of stream) {
    if (!chunk.choices.length) continue;
    text += chunk.choices[0].delta.content || '';
    finish = chunk.choices[0].finish_reason || finish;
  }
  assert.equal(text, chatPick.before);
  assert.equal(finish, 'stop');
});

// ---------- logprobs ----------

function checkTop(top, count, chosen) {
  assert.equal(top.length, count, `top_logprobs has ${count} entries`);
  for (const t of top) {
    assert.equal(typeof t.token, 'string');
    assert.ok(Number.isFinite(t.logprob) && t.logprob <= 0, `logprob ${t.logprob} <= 0`);
  }
  for (let i = 1; i < top.length; i++) assert.ok(top[i - 1].logprob >= top[i].logprob, 'top_logprobs sorted, most likely first');
  if (chosen) {
    // Greedy: the chosen token is the most likely one.
    assert.ok(Math.abs(top[0].logprob - chosen.logprob) < 1e-4, `greedy token is top-1 (${top[0].logprob} vs ${chosen.logprob})`);
  }
}

test('chat logprobs: one entry per token, top_logprobs as many as asked, sorted, <= 0', T, async () => {
  const res = await client.chat.completions.create({
    model, messages: chatMessages, max_tokens: 6, temperature: 0, logprobs: true, top_logprobs: 3,
  });
  const content = res.choices[0].logprobs?.content;
  assert.ok(Array.isArray(content), 'choices[0].logprobs.content');
  assert.equal(content.length, res.usage.completion_tokens, 'one entry per generated token');
  for (const entry of content) {
    assert.equal(typeof entry.token, 'string');
    assert.ok(entry.logprob <= 0);
    checkTop(entry.top_logprobs, 3, entry);
  }
  assert.equal(content.map((e) => e.token).join(''), res.choices[0].message.content, 'the tokens spell the content');

  // Streaming: each content chunk carries its token's logprobs.
  const stream = await client.chat.completions.create({
    model, messages: chatMessages, max_tokens: 6, temperature: 0, logprobs: true, top_logprobs: 2, stream: true,
  });
  let n = 0;
  for await (const chunk of stream) {
    for (const entry of chunk.choices[0]?.logprobs?.content || []) { n++; checkTop(entry.top_logprobs, 2, entry); }
  }
  assert.equal(n, 6, 'a logprobs entry for each of the 6 streamed tokens');

  // Without logprobs asked, none are sent.
  const plain = await client.chat.completions.create({ model, messages: chatMessages, max_tokens: 2, temperature: 0 });
  assert.ok(!plain.choices[0].logprobs, 'no logprobs unless asked');
});

test('completion logprobs (legacy shape): tokens, token_logprobs <= 0, top_logprobs per token', T, async () => {
  const res = await client.completions.create({ model, prompt: completionPrompt, max_tokens: 5, temperature: 0, logprobs: 3 });
  const lp = res.choices[0].logprobs;
  assert.ok(lp, 'choices[0].logprobs');
  assert.equal(lp.tokens.length, 5);
  assert.equal(lp.token_logprobs.length, 5);
  assert.equal(lp.top_logprobs.length, 5);
  assert.equal(lp.tokens.join(''), res.choices[0].text);
  for (let i = 0; i < 5; i++) {
    assert.ok(lp.token_logprobs[i] <= 0);
    const top = Object.values(lp.top_logprobs[i]);
    // Two token ids can decode to the same text, and a map keeps one: at most 3, at least 1.
    assert.ok(top.length >= 1 && top.length <= 3, `1..3 top entries, got ${top.length}`);
    for (const v of top) assert.ok(v <= 0);
    assert.ok(Math.abs(Math.max(...top) - lp.token_logprobs[i]) < 1e-4, 'greedy token is the most likely');
  }
});

// ---------- determinism ----------

test('greedy (temperature 0) is deterministic between two calls', T, async () => {
  const req = { model, messages: chatMessages, max_tokens: 24, temperature: 0 };
  const a = await client.chat.completions.create(req);
  const b = await client.chat.completions.create(req);
  assert.equal(a.choices[0].message.content, b.choices[0].message.content);
});

test('a seed makes sampling reproducible, and different seeds sample differently', T, async () => {
  const req = (seed) => ({ model, prompt: completionPrompt, max_tokens: 24, temperature: 1, top_p: 1, seed });
  const a = await client.completions.create(req(1234));
  const b = await client.completions.create(req(1234));
  assert.equal(a.choices[0].text, b.choices[0].text, 'the same seed gives the same text');
  // At temperature 1 over 24 tokens, three other seeds all giving the very same text would mean the seed
  // (or the temperature) is ignored.
  const others = [];
  for (const seed of [1, 2, 3]) others.push((await client.completions.create(req(seed))).choices[0].text);
  assert.ok(others.some((t) => t !== a.choices[0].text), 'other seeds give other texts');
});
