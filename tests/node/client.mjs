// The openai Node SDK against the gateway: chat completions and the Responses API, streamed and
// not. Run by tests/test_node_sdk.py with GATEWAY_URL and TAG set; prints what it received as JSON.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.GATEWAY_URL, apiKey: "sk-node", maxRetries: 0 });
const tag = process.env.TAG;
const out = {};

const { data: chat, response } = await client.chat.completions
  .create({ model: "gpt-4o-mini", messages: [{ role: "user", content: `node chat ${tag}` }] })
  .withResponse();
out.chat = chat.choices[0].message.content;
out.chatConversation = response.headers.get("x-memstrata-conversation");

const stream = await client.chat.completions.create({
  model: "gpt-4o-mini",
  stream: true,
  stream_options: { include_usage: true },
  messages: [
    { role: "user", content: `node chat ${tag}` },
    { role: "assistant", content: out.chat },
    { role: "user", content: `node stream ${tag}` },
  ],
});
let streamed = "";
for await (const chunk of stream) streamed += chunk.choices[0]?.delta?.content ?? "";
out.chatStream = streamed;

out.responses = [];
let previous;
for (const [word, streaming] of [["one", false], ["two", true], ["three", false]]) {
  const input = `node responses ${word} ${tag}`;
  const body = { model: "gpt-4o-mini", input, previous_response_id: previous };
  if (streaming) {
    const events = await client.responses.create({ ...body, stream: true });
    let text = "";
    for await (const event of events) {
      if (event.type === "response.output_text.delta") text += event.delta;
      if (event.type === "response.completed") previous = event.response.id;
    }
    out.responses.push(text);
  } else {
    const reply = await client.responses.create(body);
    previous = reply.id;
    out.responses.push(reply.output_text);
  }
}
out.retrieved = (await client.responses.retrieve(previous)).output_text;
console.log(JSON.stringify(out));
