CREATE TABLE warren_redeliveries (
    consumer_name     VARBINARY(255) NOT NULL,
    message_id        VARBINARY(255) NOT NULL,
    deliveries        BIGINT       NOT NULL,
    last_delivered_at DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer_name, message_id),
    INDEX warren_redeliveries_age (consumer_name, last_delivered_at)
) ENGINE = InnoDB;
