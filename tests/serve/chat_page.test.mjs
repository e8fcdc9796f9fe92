// The chat page at / in headless Chromium: a person types, presses Enter, and sees the answer stream in.
//
//   TQ_SERVE_BIN=build/bin/turboquant-serve node --test tests/serve/chat_page.test.mjs
//
// TQ_SCREENSHOT=docs/serve-chat.png writes a screenshot of the finished conversation there.
// TQ_CHAT_PAGE=tools/serve/web/index.html serves that file at / instead of the binary's embedded copy (to
// try the page against an older binary). CHROMIUM overrides /usr/bin/chromium.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync, mkdirSync } from 'node:fs';
import { dirname } from 'node:path';
import { chromium } from 'playwright-core';
import { startServer } from './server.mjs';

const API_KEY = 'chat-page-test-key';
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const STEP_MS = 60_000;  // the longest any single wait below may take

let server, browser;

before(async () => {
  server = await startServer(['--api-key', API_KEY, '--parallel', '2']);
  browser = await chromium.launch({
    executablePath: CHROMIUM,
    timeout: STEP_MS,
    // As root Chromium needs --no-sandbox; the network flags keep it from calling out (this machine has no
    // network, and each refused connection costs time).
    args: [
      ...(process.getuid && process.getuid() === 0 ? ['--no-sandbox'] : []),
      '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
      '--disable-component-update', '--disable-sync',
    ],
  });
});

after(async () => {
  await browser?.close();
  await server?.stop();
});

// A new page on the server, with the API key typed into its field as a person would, and requests logged.
async function openChat(viewport = { width: 1100, height: 760 }) {
  const context = await browser.newContext({ viewport });
  const page = await context.newPage();
  page.setDefaultTimeout(STEP_MS);
  const errors = [];
  page.on('pageerror', (err) => errors.push(err.message));
  const requests = [];
  page.on('request', (req) => {
    if (req.url().endsWith('/v1/chat/completions')) requests.push({ headers: req.headers(), body: req.postDataJSON() });
  });
  if (process.env.TQ_CHAT_PAGE) {
    const html = readFileSync(process.env.TQ_CHAT_PAGE, 'utf8');
    await page.route(server.url + '/', (route) => route.fulfill({ contentType: 'text/html; charset=utf-8', body: html }));
  }
  const res = await page.goto(server.url + '/');
  assert.equal(res.status(), 200, 'GET / answers 200');
  assert.match(res.headers()['content-type'] || '', /text\/html/, 'GET / is HTML');
  // On a narrow screen the settings are behind the header's button.
  const folded = await page.isVisible('#settings-toggle');
  if (folded) await page.click('#settings-toggle');
  await page.fill('#api-key', API_KEY);
  await page.locator('#api-key').dispatchEvent('change');
  if (folded) await page.keyboard.press('Escape');
  await page.waitForSelector('#status[data-state="ok"]');
  await page.waitForFunction(() => document.getElementById('kv-format').textContent !== '—');
  return { context, page, errors, requests };
}

// Records, in the page, every change to the last assistant bubble's text and to its state, with the time
// (the observer runs once per task, so updates that arrive in separate network reads get separate entries).
async function watchLastAnswer(page) {
  await page.evaluate(() => {
    window.__answer = { texts: [], states: [] };
    const log = document.getElementById('log');
    const observer = new MutationObserver(() => {
      const msgs = log.querySelectorAll('.msg[data-role="assistant"]');
      const last = msgs[msgs.length - 1];
      if (!last) return;
      const now = performance.now();
      const text = last.querySelector('.bubble').textContent;
      const t = window.__answer.texts;
      if (!t.length || t[t.length - 1].text !== text) t.push({ now, text });
      const s = window.__answer.states;
      if (!s.length || s[s.length - 1] !== last.dataset.state) s.push(last.dataset.state);
    });
    observer.observe(log, { subtree: true, childList: true, characterData: true, attributes: true, attributeFilter: ['data-state'] });
  });
}

async function lastAnswerState(page) {
  return page.$eval('#log', (log) => {
    const msgs = log.querySelectorAll('.msg[data-role="assistant"]');
    return msgs.length ? msgs[msgs.length - 1].dataset.state : null;
  });
}

test('a typed message streams an answer that shows tokens/s and the KV cache against FP16', async () => {
  const { context, page, errors, requests } = await openChat();
  try {
    await page.fill('#max-tokens', '48');
    await page.fill('#temperature', '0');
    await page.fill('#system', 'You are a helpful assistant.');

    await watchLastAnswer(page);
    await page.click('#prompt');
    await page.keyboard.type('Tell me a story about a small robot');
    // Shift+Enter is a new line in the message, not a send.
    await page.keyboard.press('Shift+Enter');
    await page.keyboard.type('who learns to read.');
    assert.equal(await page.inputValue('#prompt'), 'Tell me a story about a small robot\nwho learns to read.');
    assert.equal(await page.locator('.msg').count(), 0, 'Shift+Enter sent nothing');
    await page.keyboard.press('Enter');

    await page.waitForSelector('.msg[data-role="user"] .bubble');
    assert.equal(await page.textContent('.msg[data-role="user"] .bubble'), 'Tell me a story about a small robot\nwho learns to read.');
    assert.equal(await page.inputValue('#prompt'), '', 'the composer is emptied on send');
    assert.equal(await page.isDisabled('#stop'), false, 'Stop is enabled while the answer streams');

    await page.waitForFunction(() => {
      const m = document.querySelector('.msg[data-role="assistant"]');
      return m && (m.dataset.state === 'done' || m.dataset.state === 'error');
    });
    const state = await lastAnswerState(page);
    const bubbleText = await page.textContent('.msg[data-role="assistant"] .bubble');
    assert.equal(state, 'done', `the answer completed (bubble: ${bubbleText})`);

    // The text grew over time: several distinct lengths, each a prefix of the final text, seen in
    // separate updates while the message was in the streaming state.
    const seen = await page.evaluate(() => window.__answer);
    const final = seen.texts[seen.texts.length - 1].text;
    assert.ok(final.length > 0, 'the answer has text');
    const partial = seen.texts.filter((t) => t.text.length > 0 && t.text !== final);
    assert.ok(partial.length >= 1, `the answer appeared in pieces before it was complete (updates: ${seen.texts.length})`);
    for (const t of partial) assert.ok(final.startsWith(t.text), 'each partial text is a prefix of the answer');
    assert.ok(seen.texts[seen.texts.length - 1].now > partial[0].now, 'the text grew after it first appeared');
    assert.deepEqual(seen.states.filter((s) => s !== 'waiting'), ['streaming', 'done']);

    // Model text is text: the bubble holds no elements, whatever the model wrote.
    assert.equal(await page.$eval('.msg[data-role="assistant"] .bubble', (b) => b.children.length), 0);

    // Tokens/s of the answer, the KV format and the cache bytes against FP16.
    const tps = await page.textContent('.msg[data-role="assistant"] .meta .tps');
    assert.match(tps, /^\d+(\.\d+)? tok\/s$/, 'tokens/s shown');
    assert.ok(Number.parseFloat(tps) > 0, 'tokens/s above zero');
    assert.match(await page.textContent('.msg[data-role="assistant"] .meta'), /\d+ tokens/);
    const props = await (await fetch(server.url + '/props', { headers: { Authorization: `Bearer ${API_KEY}` } })).json();
    assert.equal(await page.textContent('#kv-format'), props.kv.describe, 'the KV format is /props kv.describe');
    assert.match(await page.textContent('#kv-bytes'), /^\d+(\.\d+)? (B|KiB|MiB|GiB) vs FP16 \d+(\.\d+)? (B|KiB|MiB|GiB)/);

    // What went to the server: the system prompt, the message, streaming, the controls, the key.
    assert.equal(requests.length, 1);
    const body = requests[0].body;
    assert.equal(body.stream, true);
    assert.equal(body.max_tokens, 48);
    assert.equal(body.temperature, 0);
    assert.deepEqual(body.messages.map((m) => m.role), ['system', 'user']);
    assert.equal(requests[0].headers.authorization, `Bearer ${API_KEY}`);

    if (process.env.TQ_SCREENSHOT) {
      mkdirSync(dirname(process.env.TQ_SCREENSHOT), { recursive: true });
      await page.screenshot({ path: process.env.TQ_SCREENSHOT });
    }

    // A second turn carries the first: user, assistant, user.
    await page.fill('#prompt', 'And then?');
    await page.press('#prompt', 'Enter');
    await page.waitForFunction(() => {
      const m = document.querySelectorAll('.msg[data-role="assistant"]');
      return m.length === 2 && ['done', 'error'].includes(m[1].dataset.state);
    });
    assert.equal(await lastAnswerState(page), 'done');
    assert.deepEqual(requests[1].body.messages.map((m) => m.role), ['system', 'user', 'assistant', 'user']);
    assert.equal(requests[1].body.messages[2].content, final, 'the history holds the answer as streamed');

    // Clear empties the conversation, and the next request starts from nothing.
    await page.click('#clear');
    assert.equal(await page.locator('.msg').count(), 0);
    assert.equal(await page.isVisible('#empty'), true);
    assert.deepEqual(errors, [], 'no script errors on the page');
  } finally {
    await context.close();
  }
});

test('Stop aborts the answer streaming now and the page stays usable', async (t) => {
  const { context, page, errors } = await openChat();
  try {
    await page.fill('#max-tokens', '2000');
    await page.fill('#temperature', '1');
    await page.fill('#prompt', 'Write a very long story.');
    await page.press('#prompt', 'Enter');
    await page.waitForFunction(() => {
      const m = document.querySelector('.msg[data-role="assistant"]');
      return m && m.dataset.state !== 'waiting';
    });
    const before = await lastAnswerState(page);
    if (before !== 'streaming') {
      // The model ended its answer before the click could land (an end-of-text token): nothing to stop.
      t.skip(`the answer was already ${before} before Stop could be pressed`);
      return;
    }
    await page.click('#stop');
    await page.waitForFunction(() => document.querySelector('.msg[data-role="assistant"]').dataset.state !== 'streaming');
    const state = await lastAnswerState(page);
    assert.ok(state === 'stopped' || state === 'done', `stopped (state ${state})`);
    assert.equal(await page.isDisabled('#send'), false, 'Send is enabled again');
    assert.equal(await page.isDisabled('#stop'), true, 'Stop is disabled again');
    assert.deepEqual(errors, []);
  } finally {
    await context.close();
  }
});

test('without the API key the page says so instead of answering', async () => {
  const context = await browser.newContext();
  const page = await context.newPage();
  page.setDefaultTimeout(STEP_MS);
  try {
    if (process.env.TQ_CHAT_PAGE) {
      const html = readFileSync(process.env.TQ_CHAT_PAGE, 'utf8');
      await page.route(server.url + '/', (route) => route.fulfill({ contentType: 'text/html; charset=utf-8', body: html }));
    }
    await page.goto(server.url + '/');
    await page.fill('#prompt', 'hello');
    await page.press('#prompt', 'Enter');
    await page.waitForSelector('.msg[data-role="assistant"][data-state="error"]');
    const text = await page.textContent('.msg[data-role="assistant"] .bubble');
    assert.match(text, /^Error: /);
    assert.equal(await page.isDisabled('#send'), false);
  } finally {
    await context.close();
  }
});

test('on a narrow screen the page fits the width and the settings open from the header', async () => {
  const { context, page, errors } = await openChat({ width: 375, height: 740 });
  try {
    const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    assert.ok(overflow <= 0, `no horizontal scrolling (${overflow} px too wide)`);
    assert.equal(await page.isVisible('#prompt'), true);
    assert.equal(await page.isVisible('#send'), true);
    assert.equal(await page.isVisible('#system'), false, 'settings are folded away');
    await page.click('#settings-toggle');
    await page.waitForFunction(() => document.getElementById('settings').getBoundingClientRect().left < window.innerWidth - 100);
    assert.equal(await page.getAttribute('#settings-toggle', 'aria-expanded'), 'true');
    await page.keyboard.press('Escape');
    assert.equal(await page.getAttribute('#settings-toggle', 'aria-expanded'), 'false', 'Escape closes the settings');
    await page.click('#settings-toggle');
    await page.click('#settings-close');
    assert.equal(await page.getAttribute('#settings-toggle', 'aria-expanded'), 'false', 'Close closes the settings');
    assert.deepEqual(errors, []);
  } finally {
    await context.close();
  }
});
