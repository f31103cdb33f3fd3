"""A producer nobody at warren wrote, through its library's documented publish call.

    produce.py LIBRARY AMQP_URL EXCHANGE ROUTING_KEY COUNT

Publishes COUNT messages to EXCHANGE, then each of them again (the same id: a
producer that retries), setting only what its format needs. LIBRARY:

- pika-bare: pika, the body the business JSON, message_id and type properties;
- pika-no-id: pika, no message_id at all (the consumer derives a key), type
  test.paid, payload {"invoiceId": "inv_N"}, each copy right behind its original;
- cloudevents-binary, cloudevents-structured: the CloudEvents SDK's RabbitMQ
  binding, published with pika;
- faststream: FastStream's RabbitBroker.publish with an explicit message_id.

Every message confirmed by the broker before the script exits.
"""

import asyncio
import json
import sys
import uuid

LIBRARY, URL, EXCHANGE, KEY, COUNT = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
JOB = {"mode": {"kind": "ok"}}
RUN = uuid.uuid4().hex[:8]


def with_pika(messages, side_by_side=False):
    """messages: (body bytes, pika.BasicProperties) pairs, each published twice:
    all of them, then all again; or each copy right behind its original."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(URL))
    channel = connection.channel()
    channel.confirm_delivery()
    order = [m for m in messages for _ in range(2)] if side_by_side else messages * 2
    for body, properties in order:
        channel.basic_publish(EXCHANGE, KEY, body, properties)
    connection.close()


def pika_bare():
    import pika

    with_pika([
        (json.dumps(JOB).encode(), pika.BasicProperties(
            message_id=str(uuid.uuid4()), content_type="application/json",
            delivery_mode=2, type="test.job"))
        for _ in range(COUNT)
    ])


def pika_no_id():
    import pika

    with_pika([
        (json.dumps({"invoiceId": f"inv_{RUN}_{i}"}).encode(), pika.BasicProperties(
            content_type="application/json", delivery_mode=2, type="test.paid"))
        for i in range(COUNT)
    ], side_by_side=True)


def cloudevents(mode):
    import pika
    from cloudevents.core.bindings import rabbitmq
    from cloudevents.core.v1.event import CloudEvent

    to_wire = rabbitmq.to_binary_event if mode == "binary" else rabbitmq.to_structured_event
    messages = []
    for i in range(COUNT):
        event = CloudEvent(
            {"type": "test.job", "source": f"/interop/{mode}/{RUN}", "id": f"e-{i}",
             "datacontenttype": "application/json"},
            JOB,
        )
        wire = to_wire(event)
        messages.append((wire.body, pika.BasicProperties(
            content_type=wire.content_type, headers=wire.headers or None, delivery_mode=2)))
    with_pika(messages)


async def faststream():
    from faststream.rabbit import RabbitBroker, RabbitExchange

    # The exchange is the consumer's: FastStream publishes to it, declaring nothing.
    exchange = RabbitExchange(EXCHANGE, declare=False)
    ids = [uuid.uuid4().hex for _ in range(COUNT)]
    async with RabbitBroker(URL) as broker:
        for _ in range(2):
            for message_id in ids:
                await broker.publish(JOB, exchange=exchange, routing_key=KEY,
                                     message_id=message_id, message_type="test.job", persist=True)


if LIBRARY == "pika-bare":
    pika_bare()
elif LIBRARY == "pika-no-id":
    pika_no_id()
elif LIBRARY == "cloudevents-binary":
    cloudevents("binary")
elif LIBRARY == "cloudevents-structured":
    cloudevents("structured")
elif LIBRARY == "faststream":
    asyncio.run(faststream())
else:
    sys.exit(f"unknown library {LIBRARY!r}")
