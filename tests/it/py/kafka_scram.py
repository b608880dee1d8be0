"""Prepares a tansu broker started with --authentication for the SASL tests (confluent-kafka).

    kafka_scram.py BROKERS USER PASSWORD TOPIC

Run against the broker started WITHOUT --authentication on the storage it will use with it
(tansu 0.6 from crates.io offers no SASL mechanism but SCRAM, so nothing could log in first):
stores SCRAM-SHA-256 and SCRAM-SHA-512 credentials for USER (AlterUserScramCredentials) and
creates TOPIC. Exits non-zero with the broker's error on any failure.
"""

import sys

from confluent_kafka.admin import (
    AdminClient,
    NewTopic,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

brokers, user, password, topic = sys.argv[1:5]
admin = AdminClient({"bootstrap.servers": brokers})
upserts = [
    UserScramCredentialUpsertion(user, ScramCredentialInfo(m, 4096), password.encode())
    for m in (ScramMechanism.SCRAM_SHA_256, ScramMechanism.SCRAM_SHA_512)
]
for fut in admin.alter_user_scram_credentials(upserts).values():
    fut.result(timeout=20)
for fut in admin.create_topics([NewTopic(topic, num_partitions=1)]).values():
    fut.result(timeout=20)
print("ok")
