// Parses an AsyncAPI document (stdin) with the AsyncAPI project's parser and prints, as JSON,
// its diagnostics and the messages each channel carries: tests/unit/test_asyncapi.py reads it.
import { Parser } from "@asyncapi/parser";

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const parser = new Parser();
const { document, diagnostics } = await parser.parse(Buffer.concat(chunks).toString("utf8"));
const channels = {};
for (const channel of document?.channels().all() ?? []) {
  channels[channel.id()] = channel.messages().all().map((m) => m.name());
}
const severities = ["error", "warning", "information", "hint"];
console.log(
  JSON.stringify({
    valid: document !== undefined,
    diagnostics: diagnostics.map((d) => ({
      severity: severities[d.severity] ?? String(d.severity),
      code: d.code,
      message: d.message,
      path: d.path.join("/"),
    })),
    channels,
  }),
);
