// Starts turboquant-serve for a test file and stops it afterwards, every wait bounded in time.
//
// The binary comes from TQ_SERVE_BIN (run.sh sets it from its argument). TQ_SERVE_URL instead points the
// tests at a server that is already running (it is then neither started nor stopped here).
import { spawn } from 'node:child_process';
import { createServer } from 'node:net';
import { setTimeout as sleep } from 'node:timers/promises';
import { fileURLToPath } from 'node:url';

// A chat template for models that have none (the demo model), for --chat-template.
export const CHAT_TEMPLATE = fileURLToPath(new URL('./chat_template.jinja', import.meta.url));

// A port the kernel says is free now. Another process could take it before the server binds it; the
// server then fails to start and the test says so, which is rare enough on 127.0.0.1.
export function freePort() {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.unref();
    srv.on('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

// Polls GET /health until it answers 200, the process exits, or timeoutMs passes.
async function waitHealthy(url, proc, timeoutMs) {
  const deadline = Date.now() + timeoutMs;
  let last = 'no answer';
  while (Date.now() < deadline) {
    if (proc && proc.exitCode !== null) throw new Error(`turboquant-serve exited with ${proc.exitCode} before it was healthy`);
    try {
      const res = await fetch(url + '/health', { signal: AbortSignal.timeout(2000) });
      last = `HTTP ${res.status}`;
      if (res.status === 200) return;
    } catch (err) {
      last = err.cause?.code || err.message;
    }
    await sleep(100);
  }
  throw new Error(`turboquant-serve was not healthy within ${timeoutMs} ms (last: ${last})`);
}

// Returns {url, stop(), output()}. extraArgs go to the server after --host and --port.
export async function startServer(extraArgs = [], { timeoutMs = 120_000 } = {}) {
  if (process.env.TQ_SERVE_URL) {
    const url = process.env.TQ_SERVE_URL.replace(/\/$/, '');
    await waitHealthy(url, null, timeoutMs);
    return { url, stop: async () => {}, output: () => '', external: true };
  }
  const bin = process.env.TQ_SERVE_BIN;
  if (!bin) throw new Error('set TQ_SERVE_BIN to the turboquant-serve binary (or TQ_SERVE_URL to a running server)');
  const port = await freePort();
  const args = ['--host', '127.0.0.1', '--port', String(port), ...extraArgs];
  const proc = spawn(bin, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  let log = '';
  const keep = (d) => { log = (log + d.toString()).slice(-20000); };  // the tail, for a failure's message
  proc.stdout.on('data', keep);
  proc.stderr.on('data', keep);
  const exited = new Promise((resolve) => proc.once('exit', resolve));
  proc.once('error', (err) => { log += `\nspawn error: ${err.message}`; });
  const stop = async () => {
    if (proc.exitCode !== null || proc.signalCode !== null) return;
    proc.kill('SIGTERM');
    const done = await Promise.race([exited.then(() => true), sleep(5000).then(() => false)]);
    if (!done) { proc.kill('SIGKILL'); await Promise.race([exited, sleep(2000)]); }
  };
  const url = `http://127.0.0.1:${port}`;
  try {
    await waitHealthy(url, proc, timeoutMs);
  } catch (err) {
    await stop();
    throw new Error(`${err.message}\n${bin} ${args.join(' ')}\n--- server output ---\n${log}`);
  }
  return { url, stop, output: () => log, external: false, port };
}
