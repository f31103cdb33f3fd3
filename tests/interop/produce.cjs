// A producer nobody at warren wrote: Node's amqplib on a confirm channel.
//
//   NODE_PATH=.../node_modules node produce.cjs AMQP_URL EXCHANGE ROUTING_KEY COUNT
//
// Publishes COUNT bare JSON payloads (messageId and type properties), then
// each again with the same id, and waits for the broker's confirms.
// CommonJS: NODE_PATH finds amqplib where .ci/interop-setup installed it.
const { randomUUID } = require("node:crypto");
const amqp = require("amqplib");

async function main() {
  const [url, exchange, key, count] = process.argv.slice(2);
  const connection = await amqp.connect(url);
  const channel = await connection.createConfirmChannel();
  const ids = Array.from({ length: Number(count) }, () => randomUUID());
  for (let round = 0; round < 2; round++) {
    for (const messageId of ids) {
      channel.publish(exchange, key, Buffer.from(JSON.stringify({ mode: { kind: "ok" } })), {
        messageId,
        contentType: "application/json",
        type: "test.job",
        persistent: true,
      });
    }
  }
  await channel.waitForConfirms();
  await connection.close();
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
