"""A producer nobody at warren wrote, through its library's documented publish call.

    produce.py LIBRARY AMQP_URL EXCHANGE ROUTING_KEY COUNT

Publishes COUNT messages to EXCHANGE, then each of them again (the same id: a
producer that retries), setting only what its format needs. LIBRARY:

- pika-bare: pika, the body the business JSON, message_id and type properties;
- pika-no-id: pika, no message_id at all (the consumer derives a key), type
  test.paid, payload {"invoiceId": "inv_N"}, each copy right behind its original;
- cloudevents-binary, cloudevents-structured: the CloudEvents SDK's RabbitMQ
  binding, published with pika;
- faststream: FastStream's RabbitBroker.publish with an explicit message_id;
- pika-masstransit, pika-nservicebus, pika-spring: pika, each message shaped as
  that framework's RabbitMQ transport documents it (MassTransit's JSON envelope
  of type urn:message:Warren.Tests:Job; NServiceBus's headers enclosing
  Warren.Tests.Job; Spring AMQP's Jackson converter, __TypeId__
  com.example.warren.Job, with message ids turned on);
- pika-hostile: COUNT is ignored; each hostile case once (its name in the
  header test-case), each followed by a valid bare payload, message_id
  follow-CASE, published twice.

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


def frameworks(kind):
    import datetime
    import pika

    now = datetime.datetime.now(datetime.timezone.utc)
    messages = []
    for _ in range(COUNT):
        message_id = str(uuid.uuid4())
        conversation = str(uuid.uuid4())
        if kind == "masstransit":
            body = {
                "messageId": message_id, "conversationId": conversation,
                "sourceAddress": "rabbitmq://localhost/interop",
                "destinationAddress": f"rabbitmq://localhost/{EXCHANGE}",
                "messageType": ["urn:message:Warren.Tests:Job"],
                "message": JOB,
                "sentTime": now.strftime("%Y-%m-%dT%H:%M:%S.%f") + "0Z",
                "headers": {},
                "host": {"machineName": "interop", "processName": "produce.py",
                         "massTransitVersion": "8.3.4.0"},
            }
            messages.append((json.dumps(body).encode(), pika.BasicProperties(
                message_id=message_id, content_type="application/vnd.masstransit+json",
                delivery_mode=2)))
        elif kind == "nservicebus":
            headers = {
                "NServiceBus.MessageId": message_id,
                "NServiceBus.EnclosedMessageTypes":
                    "Warren.Tests.Job, Warren.Tests, Version=1.0.0.0, Culture=neutral, PublicKeyToken=null",
                "NServiceBus.ContentType": "application/json",
                "NServiceBus.TimeSent": now.strftime("%Y-%m-%d %H:%M:%S:%f Z"),
                "NServiceBus.ConversationId": conversation,
                "NServiceBus.MessageIntent": "Publish",
                "NServiceBus.Version": "9.2.3",
            }
            messages.append((json.dumps(JOB).encode(), pika.BasicProperties(
                message_id=message_id, headers=headers, delivery_mode=2)))
        else:
            messages.append((json.dumps(JOB).encode(), pika.BasicProperties(
                message_id=message_id, content_type="application/json",
                content_encoding="UTF-8", headers={"__TypeId__": "com.example.warren.Job"},
                delivery_mode=2)))
    with_pika(messages)


def hostile():
    """Each case once, named in the header test-case, then a valid follower twice."""
    import pika

    structured = "application/cloudevents+json"

    def ce(**attributes):
        event = {"specversion": "1.0", "id": "e-1", "source": f"/hostile/{RUN}",
                 "type": "test.job", "datacontenttype": "application/json", "data": JOB}
        event.update(attributes)
        return json.dumps({k: v for k, v in event.items() if v is not None}).encode()

    def binary(**headers):
        base = {"ce-specversion": "1.0", "ce-id": f"b-{uuid.uuid4()}",
                "ce-source": f"/hostile/{RUN}", "ce-type": "test.job"}
        base.update(headers)
        return {k: v for k, v in base.items() if v is not None}

    job = json.dumps(JOB).encode()
    cases = [
        ("ce-id-too-long", job, dict(content_type="application/json",
                                     headers=binary(**{"ce-id": "x" * 201}))),
        ("ce-source-control", job, dict(content_type="application/json",
                                        headers=binary(**{"ce-source": "/a\x01b"}))),
        ("ce-data-not-json", ce(datacontenttype="text/plain", data="hello"),
         dict(content_type=structured)),
        ("ce-broken-body", b'{"specversion":"1.0","id":', dict(content_type=structured)),
        ("ce-data-base64", ce(data=None, data_base64="aGVsbG8="), dict(content_type=structured)),
        ("ce-binary-text", b"hello", dict(content_type="text/plain", headers=binary())),
        ("ce-specversion", ce(specversion="0.3"), dict(content_type=structured)),
        ("ce-two-prefixes", job, dict(content_type="application/json",
                                      headers=binary(**{"ce-id": "a", "cloudEvents_id": "b"}))),
        ("ce-id-boolean", job, dict(content_type="application/json",
                                    headers=binary(**{"ce-id": True}))),
        ("masstransit-unknown-type", json.dumps({
            "messageId": str(uuid.uuid4()), "messageType": ["urn:message:Shop:OrderPlaced"],
            "message": JOB}).encode(), dict(content_type="application/vnd.masstransit+json")),
        ("bare-unknown-type", job, dict(content_type="application/json",
                                        message_id=str(uuid.uuid4()), type="shop.unknown")),
        ("bare-id-too-long", job, dict(content_type="application/json",
                                       message_id="m" * 201, type="test.job")),
        ("bare-no-type", job, dict(content_type="application/json",
                                   message_id=str(uuid.uuid4()))),
        ("derived-key-too-long", json.dumps({"invoiceId": "i" * 250}).encode(),
         dict(content_type="application/json", type="test.paid")),
        ("masstransit-id-mismatch", json.dumps({
            "messageId": str(uuid.uuid4()), "messageType": ["urn:message:Warren.Tests:Job"],
            "message": JOB}).encode(), dict(content_type="application/vnd.masstransit+json",
                                            message_id=str(uuid.uuid4()))),
        ("nservicebus-unknown-type", job, dict(message_id=(nsb := str(uuid.uuid4())), headers={
            "NServiceBus.MessageId": nsb,
            "NServiceBus.EnclosedMessageTypes": "Shop.OrderPlaced, Shop, Version=1.0.0.0"})),
        ("nservicebus-id-mismatch", job, dict(message_id=str(uuid.uuid4()), headers={
            "NServiceBus.MessageId": str(uuid.uuid4()),
            "NServiceBus.EnclosedMessageTypes": "Warren.Tests.Job, Warren.Tests"})),
        ("spring-unknown-type", job, dict(content_type="application/json",
                                          message_id=str(uuid.uuid4()),
                                          headers={"__TypeId__": "com.example.shop.Order"})),
    ]
    import pika as p
    connection = p.BlockingConnection(p.URLParameters(URL))
    channel = connection.channel()
    channel.confirm_delivery()
    for case, body, properties in cases:
        headers = dict(properties.pop("headers", {}))
        headers["test-case"] = case
        channel.basic_publish(EXCHANGE, KEY, body,
                              p.BasicProperties(headers=headers, delivery_mode=2, **properties))
        follower = p.BasicProperties(message_id=f"follow-{case}-{RUN}",
                                     content_type="application/json", type="test.job",
                                     delivery_mode=2)
        for _ in range(2):
            channel.basic_publish(EXCHANGE, KEY, job, follower)
    # Structured wins over ce- headers beside it: read from the body, applied
    # once though sent twice.
    for _ in range(2):
        channel.basic_publish(EXCHANGE, KEY, ce(id=f"structured-wins-{RUN}"), p.BasicProperties(
            content_type=structured, delivery_mode=2,
            headers={"test-case": "structured-wins", "ce-id": "ignored",
                     "ce-specversion": "0.3", "ce-type": "shop.unknown"}))
    connection.close()


if LIBRARY == "pika-bare":
    pika_bare()
elif LIBRARY == "pika-no-id":
    pika_no_id()
elif LIBRARY == "cloudevents-binary":
    cloudevents("binary")
elif LIBRARY == "cloudevents-structured":
    cloudevents("structured")
elif LIBRARY in ("pika-masstransit", "pika-nservicebus", "pika-spring"):
    frameworks(LIBRARY.removeprefix("pika-"))
elif LIBRARY == "pika-hostile":
    hostile()
elif LIBRARY == "faststream":
    asyncio.run(faststream())
else:
    sys.exit(f"unknown library {LIBRARY!r}")
