// The Vercel AI SDK's Responses provider against the gateway, as an app uses it: a chat whose
// history goes back with each turn (an earlier reply as an `item_reference`: `store` is on by
// default), and a named conversation (`conversation`) whose tool loop resends the step's
// question with the results. Run by tests/test_node_sdk.py with GATEWAY_URL and TAG set; prints
// what it received as JSON.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, stepCountIs, tool } from "ai";
import { z } from "zod";

const seen = [];
async function recording(url, init) {
  const response = await fetch(url, init);
  seen.push(response.headers.get("x-memstrata-conversation"));
  return response;
}
const provider = createOpenAI({ baseURL: process.env.GATEWAY_URL, apiKey: "sk-ai", fetch: recording });
const model = provider.responses("gpt-4o-mini");
const tag = process.env.TAG;
const out = { chat: [], named: [] };

const messages = [];
for (const word of ["one", "two", "three"]) {
  messages.push({ role: "user", content: `ai chat ${word} ${tag}` });
  const result = await generateText({ model, system: "Be brief.", messages, maxRetries: 0 });
  out.chat.push(result.text);
  messages.push(...result.response.messages);
}
out.chatConversations = [...new Set(seen)];

const weather = tool({
  description: "The weather in a city",
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => `sunny in ${city}`,
});
const providerOptions = { openai: { conversation: `ai-named-${tag}` } };
for (const text of [`hello ${tag}`, `weather in Kyiv ${tag}`, `thanks ${tag}`]) {
  const result = await generateText({
    model,
    messages: [{ role: "user", content: text }],
    tools: { weather },
    stopWhen: stepCountIs(3),
    providerOptions,
    maxRetries: 0,
  });
  out.named.push(result.text);
}
console.log(JSON.stringify(out));
