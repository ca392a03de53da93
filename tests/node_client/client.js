#!/usr/bin/env node
// A wafl federation client written from protos/wafl/v1/federation.proto alone (the conformance
// test of the wire contract). It imports nothing of wafl: the .proto is loaded at run time with
// @grpc/proto-loader and spoken with @grpc/grpc-js.
//
// It joins, receives every broadcast (single chunks and chunk batches), checks each transfer
// against the manifest (tensor order, byte offsets, sizes, chunk count, CRC-32), and for every
// model it is asked to train on uploads a deterministic update: the model plus a small
// perturbation, as single chunks and batches. Two uploads test exactly-once delivery: for
// --drop-reply-round the reply of the first attempt is ignored as if lost, for --cancel-round the
// call is cancelled right after the trailer was written; both are retried under the same
// idempotency key and must be answered OK. After the final broadcast it sends its final Report
// and exits 0. Any breach of the contract exits 1 with a message.
//
// --out DIR receives summary.json (manifest, every model and upload, every reply) and the raw
// tensor bytes of every model received (recv-<round>.bin) and uploaded (up-<round>.bin), in
// manifest order, for the test to re-compute the aggregate.
"use strict";

const crypto = require("node:crypto");
const fs = require("node:fs");
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const MIB = 1 << 20;
const ITEMSIZE = { FLOAT32: 4, FLOAT16: 2, BFLOAT16: 2, FLOAT64: 8, INT64: 8, INT32: 4, UINT8: 1, BOOL: 1 };
const UPLOAD_CHUNK = 256 << 10; // upload chunk size: a large tensor travels as several single chunks
const TRANSIENT = new Set([grpc.status.UNAVAILABLE, grpc.status.CANCELLED, grpc.status.DEADLINE_EXCEEDED]);

function parseArgs(argv) {
  const out = { dropReplyRound: -1, cancelRound: -1, numSamples: 100, index: 0, token: "" };
  for (let i = 2; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, "").replace(/-([a-z])/g, (_, c) => c.toUpperCase());
    out[key] = argv[i + 1];
  }
  for (const k of ["dropReplyRound", "cancelRound", "numSamples", "index"]) out[k] = Number(out[k]);
  for (const k of ["server", "proto", "out", "clientId"]) {
    if (!out[k]) throw new Error(`--${k.replace(/[A-Z]/g, (c) => "-" + c.toLowerCase())} is required`);
  }
  return out;
}

// CRC-32 as zlib computes it (reflected polynomial 0xEDB88320, initial value and final xor 0xFFFFFFFF).
const CRC_TABLE = (() => {
  const t = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    t[n] = c >>> 0;
  }
  return t;
})();

function crc32(buf, crc = 0) {
  let c = (crc ^ 0xffffffff) >>> 0;
  for (let i = 0; i < buf.length; i++) c = CRC_TABLE[(c ^ buf[i]) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

function fail(message) {
  const err = new Error(message);
  err.contract = true;
  throw err;
}

function nbytes(spec) {
  return spec.shape.reduce((a, d) => a * Number(d), 1) * ITEMSIZE[spec.dtype];
}

// Reassembles one transfer (broadcast direction) and checks it as the .proto describes.
class Assembler {
  constructor(manifest, header) {
    this.manifest = manifest;
    this.header = header;
    this.buffers = manifest.map((s) => Buffer.alloc(nbytes(s)));
    this.index = 0; // tensor expected next
    this.offset = 0; // byte offset expected next inside it
    this.seen = false; // a chunk of the current tensor arrived
    this.chunks = 0;
    this.singles = 0; // chunk messages
    this.batches = 0; // batch messages
    this.knowledge = [];
  }

  chunk(c) {
    if (this.knowledge.length) fail("tensor chunk after knowledge");
    let spec = this.manifest[this.index];
    if (spec && this.seen && this.offset === this.buffers[this.index].length && c.name !== spec.name) {
      this.index += 1;
      this.offset = 0;
      this.seen = false;
      spec = this.manifest[this.index];
    }
    if (!spec || c.name !== spec.name) fail(`chunk of ${c.name} where ${spec ? spec.name : "nothing"} was expected`);
    if (c.dtype !== spec.dtype) fail(`chunk of ${c.name}: dtype ${c.dtype}, manifest ${spec.dtype}`);
    if (c.shape.map(Number).join(",") !== spec.shape.map(Number).join(",")) fail(`chunk of ${c.name}: shape differs`);
    const off = Number(c.offset);
    if (off !== this.offset) fail(`chunk of ${c.name} at byte ${off}, expected byte ${this.offset}`);
    const buf = this.buffers[this.index];
    if (off + c.data.length > buf.length) fail(`chunk of ${c.name} ends past the tensor`);
    if (c.data.length % ITEMSIZE[spec.dtype]) fail(`chunk of ${c.name}: not whole elements`);
    c.data.copy(buf, off);
    this.offset += c.data.length;
    this.seen = true;
    this.chunks += 1;
  }

  finish(trailer) {
    const last = this.manifest.length - 1;
    const complete = this.index === last && this.seen && this.offset === this.buffers[last].length;
    if (!complete) fail(`round ${this.header.round}: transfer ended at tensor ${this.index}, byte ${this.offset}`);
    let crc = 0;
    for (const b of this.buffers) crc = crc32(b, crc);
    if (crc !== trailer.crc32 >>> 0) fail(`round ${this.header.round}: CRC-32 ${crc} != trailer ${trailer.crc32}`);
    if (Number(trailer.num_chunks) !== this.chunks) {
      fail(`round ${this.header.round}: trailer counts ${trailer.num_chunks} chunks, ${this.chunks} arrived`);
    }
    return crc;
  }
}

// The update: float32 tensors plus a small deterministic perturbation, other dtypes unchanged.
function makeUpdate(manifest, buffers, index, round) {
  return manifest.map((spec, t) => {
    const src = buffers[t];
    if (spec.dtype !== "FLOAT32") return Buffer.from(src);
    const x = new Float32Array(src.buffer.slice(src.byteOffset, src.byteOffset + src.length));
    for (let i = 0; i < x.length; i++) x[i] += (((i * 7 + round * 13 + index * 5 + t) % 101) - 50) * 1e-4;
    return Buffer.from(x.buffer);
  });
}

// Upload messages: header, tensors in manifest order (large ones as single chunks, runs of small
// chunks as batches of at most 1 MiB of data), trailer.
function uploadMessages(manifest, tensors, header) {
  const chunks = [];
  manifest.forEach((spec, t) => {
    const data = tensors[t];
    const step = UPLOAD_CHUNK - (UPLOAD_CHUNK % ITEMSIZE[spec.dtype]);
    const base = { name: spec.name, dtype: spec.dtype, shape: spec.shape };
    if (data.length === 0) chunks.push({ ...base, offset: 0, data });
    for (let off = 0; off < data.length; off += step) {
      chunks.push({ ...base, offset: off, data: data.subarray(off, off + step) });
    }
  });
  const msgs = [{ header }];
  let crc = 0;
  let group = [];
  let size = 0;
  let singles = 0;
  let batches = 0;
  const flush = () => {
    if (group.length === 1) {
      msgs.push({ chunk: group[0] });
      singles += 1;
    } else if (group.length > 1) {
      msgs.push({ batch: { chunks: group } });
      batches += 1;
    }
    group = [];
    size = 0;
  };
  for (const c of chunks) {
    crc = crc32(c.data, crc);
    if (c.data.length >= UPLOAD_CHUNK) {
      flush();
      group = [c];
      flush();
      continue;
    }
    if (size + c.data.length > MIB) flush();
    group.push(c);
    size += c.data.length;
  }
  flush();
  msgs.push({ trailer: { crc32: crc, num_chunks: chunks.length } });
  return { msgs, crc, numChunks: chunks.length, singles, batches };
}

class Client {
  constructor(args) {
    this.args = args;
    const def = protoLoader.loadSync(args.proto, {
      keepCase: true,
      longs: Number,
      enums: String,
      defaults: true,
      oneofs: true,
    });
    const wafl = grpc.loadPackageDefinition(def).wafl.v1;
    this.stub = new wafl.Federation(args.server, grpc.credentials.createInsecure(), {
      "grpc.max_receive_message_length": 2 * MIB,
    });
    this.metadata = new grpc.Metadata();
    this.start = process.hrtime.bigint();
    this.startUnix = Date.now() / 1000;
    this.timeline = [];
    this.bytesUp = 0;
    this.summary = { client_id: args.clientId, models: [], uploads: [], manifest: [] };
  }

  now() {
    return Number(process.hrtime.bigint() - this.start) / 1e9;
  }

  unary(method, request) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, this.metadata, { deadline: Date.now() + 30000 }, (err, reply) =>
        err ? reject(err) : resolve(reply),
      );
    });
  }

  async join() {
    const reply = await this.unary("Join", {
      client_id: this.args.clientId,
      token: this.args.token,
      protocol_version: 1,
      client_index: this.args.index,
      num_samples: this.args.numSamples,
      device: "node",
    });
    this.runId = reply.run_id;
    this.manifest = reply.manifest.map((s) => ({ name: s.name, dtype: s.dtype, shape: s.shape.map(Number) }));
    if (!this.manifest.length) fail("empty manifest");
    if (reply.session_credential) this.metadata.set("wafl-credential", reply.session_credential);
    // an upload may declare at most this index's share of the data
    if (!(Number(reply.max_samples) > 0)) fail(`max_samples ${reply.max_samples} in the Join reply`);
    this.samples = Math.min(this.args.numSamples, Number(reply.max_samples));
    this.summary.num_samples = this.samples;
    this.summary.run_id = this.runId;
    this.summary.manifest = this.manifest;
    this.summary.config = JSON.parse(reply.config_json);
    return reply;
  }

  // One attempt of an upload: resolves with the reply, rejects with the gRPC error. `cancel`
  // cancels the call right after the trailer was written (the reply is never seen).
  attempt(msgs, cancel) {
    return new Promise((resolve, reject) => {
      const call = this.stub.Upload(this.metadata, { deadline: Date.now() + 120000 }, (err, reply) =>
        err ? reject(err) : resolve(reply),
      );
      let i = 0;
      const pump = () => {
        while (i < msgs.length) {
          const ok = call.write(msgs[i++]);
          if (!ok) {
            call.once("drain", pump);
            return;
          }
        }
        call.end();
        if (cancel) setImmediate(() => call.cancel());
      };
      pump();
    });
  }

  async upload(round, buffers) {
    const t0 = this.now();
    const tensors = makeUpdate(this.manifest, buffers, this.args.index, round);
    const key = crypto.randomUUID();
    const header = {
      run_id: this.runId,
      round,
      client_id: this.args.clientId,
      num_samples: this.samples,
      idempotency_key: key,
      metrics: { train_loss: 1 / (round + 1), train_steps: 1 },
    };
    const { msgs, crc, numChunks, singles, batches } = uploadMessages(this.manifest, tensors, header);
    const bytes = tensors.reduce((a, b) => a + b.length, 0);
    const rec = { round, key, crc32: crc, bytes, num_chunks: numChunks, singles, batches, attempts: [] };
    this.summary.uploads.push(rec);
    fs.writeFileSync(path.join(this.args.out, `up-${round}.bin`), Buffer.concat(tensors));
    let mode = round === this.args.dropReplyRound ? "drop" : round === this.args.cancelRound ? "cancel" : "plain";
    let reply = null;
    for (let tries = 0; tries < 20 && reply === null; tries++) {
      try {
        const r = await this.attempt(msgs, mode === "cancel");
        rec.attempts.push({ mode, status: "OK", round: r.round, bytes_received: r.bytes_received });
        if (mode === "drop") {
          mode = "plain"; // the reply was "lost": retry under the same key
          continue;
        }
        reply = r;
      } catch (err) {
        rec.attempts.push({ mode, status: grpc.status[err.code], details: err.details });
        if (mode === "plain" && !TRANSIENT.has(err.code)) {
          fail(`upload for round ${round} refused: ${grpc.status[err.code]} ${err.details}`);
        }
        mode = "plain";
        await new Promise((r) => setTimeout(r, 200));
      }
    }
    if (reply === null) fail(`upload for round ${round}: no OK after ${rec.attempts.length} attempts`);
    if (!reply.accepted || Number(reply.round) !== round || Number(reply.bytes_received) !== bytes) {
      fail(`upload for round ${round}: unexpected reply ${JSON.stringify(reply)}`);
    }
    for (const a of rec.attempts.filter((a) => a.status === "OK")) {
      if (a.round !== round || a.bytes_received !== bytes) fail(`round ${round}: replies differ ${JSON.stringify(a)}`);
    }
    this.bytesUp += bytes;
    this.timeline.push({ phase: "upload", round, start_s: t0, end_s: this.now() });
  }

  // Every broadcast until the final one; uploads run one after another beside the stream.
  broadcasts() {
    return new Promise((resolve, reject) => {
      const call = this.stub.Broadcasts({ run_id: this.runId, client_id: this.args.clientId }, this.metadata);
      let asm = null;
      let uploads = Promise.resolve();
      let done = false;
      let finalSeen = false; // the server ends the stream after the final model
      const stop = (err) => {
        if (done) return;
        done = true;
        call.cancel();
        if (err) reject(err);
      };
      call.on("data", (msg) => {
        try {
          if (msg.kind === "header") {
            if (asm !== null) fail("header inside a transfer");
            if (msg.header.run_id !== this.runId) fail(`broadcast of run ${msg.header.run_id}`);
            asm = new Assembler(this.manifest, msg.header);
          } else if (msg.kind === "chunk") {
            asm.chunk(msg.chunk);
            asm.singles += 1;
          } else if (msg.kind === "batch") {
            if (!msg.batch.chunks.length) fail("empty batch");
            for (const c of msg.batch.chunks) asm.chunk(c);
            asm.batches += 1;
          } else if (msg.kind === "knowledge") {
            asm.knowledge.push(msg.knowledge);
          } else if (msg.kind === "trailer") {
            const crc = asm.finish(msg.trailer);
            const h = asm.header;
            const round = Number(h.round);
            fs.writeFileSync(path.join(this.args.out, `recv-${round}.bin`), Buffer.concat(asm.buffers));
            this.summary.models.push({
              round,
              train: h.train,
              final: h.final,
              crc32: crc,
              num_chunks: asm.chunks,
              singles: asm.singles,
              batches: asm.batches,
              total_bytes: Number(h.total_bytes),
            });
            const buffers = asm.buffers;
            asm = null;
            if (h.final) {
              finalSeen = true;
              uploads.then(() => this.finalReport(round, crc)).then(() => {
                stop();
                resolve();
              }, stop);
            } else if (h.train) {
              uploads = uploads.then(() => this.upload(round, buffers));
              uploads.catch(stop);
            }
          } else {
            fail(`unexpected broadcast message ${msg.kind}`);
          }
        } catch (err) {
          stop(err);
        }
      });
      call.on("error", (err) => {
        if (!done && !finalSeen) stop(err);
      });
      call.on("end", () => {
        if (!done && !finalSeen) stop(new Error("the broadcast stream ended before the final model"));
      });
    });
  }

  async finalReport(finalRound, crc) {
    await this.unary("Report", {
      run_id: this.runId,
      client_id: this.args.clientId,
      round: finalRound - 1,
      metrics: { final: 1, bytes_up: this.bytesUp, global_crc32: crc },
      timeline: this.timeline,
      client_start_unix: this.startUnix,
    });
    this.summary.final_reported = true;
  }
}

async function main() {
  const args = parseArgs(process.argv);
  fs.mkdirSync(args.out, { recursive: true });
  const client = new Client(args);
  try {
    await client.join();
    await client.broadcasts();
  } finally {
    fs.writeFileSync(path.join(args.out, "summary.json"), JSON.stringify(client.summary, null, 1));
    client.stub.close();
  }
}

main().then(
  () => process.exit(0),
  (err) => {
    const what = err.contract ? "contract" : err.code !== undefined ? `gRPC ${grpc.status[err.code]}` : "error";
    process.stderr.write(`node client: ${what}: ${err.details || err.message}\n`);
    process.exit(1);
  },
);
