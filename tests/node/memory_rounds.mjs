// The openai Node SDK against a gateway that offers its memory tools, through the Responses API:
// the upstream is scripted (by tests/test_node_sdk.py) to call a memory tool before it answers,
// once for a stream and once for a whole response. Prints what the SDK received as JSON.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.GATEWAY_URL, apiKey: "sk-node", maxRetries: 0 });
const tag = process.env.TAG;
const out = {};

const events = await client.responses.create({
  model: "gpt-4o-mini",
  input: `node memory stream ${tag}`,
  stream: true,
});
let text = "";
const kinds = [];
for await (const event of events) {
  kinds.push(event.type);
  if (event.type === "response.output_text.delta") text += event.delta;
  if (event.type === "response.created") out.createdId = event.response.id;
  if (event.type === "response.completed") out.completed = event.response;
}
out.streamText = text;
out.kinds = kinds;

const whole = await client.responses.create({
  model: "gpt-4o-mini",
  input: `node memory whole ${tag}`,
  previous_response_id: out.completed.id,
});
out.wholeText = whole.output_text;
out.wholeOutput = whole.output.map((item) => item.type);
console.log(JSON.stringify(out));
