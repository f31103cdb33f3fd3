CREATE TABLE warren_redeliveries (
    consumer_name     TEXT        NOT NULL,
    message_id        TEXT        NOT NULL,
    deliveries        BIGINT      NOT NULL,
    last_delivered_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, message_id)
);
