# zdelay container image:   docker build -t zdelay .
#
# Runs `zdelay run` as uid 65532 on a distroless base (no shell, no package manager). The
# config is /etc/zdelay/zdelay.toml (mount your own over it) and ZDELAY_<SECTION>__<FIELD>
# variables override it; secrets belong in those variables. The admin port (/metrics,
# /healthz, /readyz) listens on 0.0.0.0:9464.
#
# No Docker engine runs in CI: scripts/image-check.sh lints this file (hadolint) and runs its
# steps outside Docker, reading them from here — the stub dependency build, the release
# build, and the runtime stage's COPY / ENV / USER / ENTRYPOINT / CMD lines (one source per
# runtime COPY). Libraries the binary links that the base does not ship must be copied
# below: the check runs the binary in a root holding only the base's libraries and what
# this file copies.

ARG RUST_VERSION=1.95.0

FROM rust:${RUST_VERSION}-bookworm AS build
# tzdata and ca-certificates are copied into the runtime image; zlib1g provides libz.so.1,
# which librdkafka (the Kafka sink) links. Not pinned (DL3008): Debian drops superseded
# versions from its mirror, so a pin would break the build at the next security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates tzdata zlib1g \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src

# Dependency layer: the manifests and the lock file with stub sources, built once and reused
# until Cargo.toml or Cargo.lock change.
COPY Cargo.toml Cargo.lock ./
COPY crates/zdelay-core/Cargo.toml crates/zdelay-core/Cargo.toml
# The producer library's and the benchmark's manifests only so that the workspace loads:
# `cargo build` at the root builds the zdelay package (and the core) alone, so the image
# carries no benchmark.
COPY crates/zdelay-client/Cargo.toml crates/zdelay-client/Cargo.toml
COPY crates/zdelay-bench/Cargo.toml crates/zdelay-bench/Cargo.toml
RUN mkdir -p src crates/zdelay-core/src crates/zdelay-client/src crates/zdelay-bench/src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs crates/zdelay-core/src/lib.rs crates/zdelay-client/src/lib.rs \
        crates/zdelay-bench/src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src crates/zdelay-core/src crates/zdelay-client/src crates/zdelay-bench/src

# The project. The touch makes cargo rebuild the two crates over their stubs whatever the
# copied files' modification times.
COPY . .
RUN touch src/main.rs src/lib.rs crates/zdelay-core/src/lib.rs \
    && cargo build --release --locked

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /usr/share/zoneinfo /usr/share/zoneinfo
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /lib/*-linux-gnu/libz.so.1 /lib/
COPY --from=build /src/target/release/zdelay /usr/local/bin/zdelay
COPY config/zdelay.toml /etc/zdelay/zdelay.toml
ENV ZDELAY_CONFIG=/etc/zdelay/zdelay.toml \
    ZDELAY_ADMIN__LISTEN=0.0.0.0:9464
USER 65532:65532
EXPOSE 9464
ENTRYPOINT ["/usr/local/bin/zdelay"]
CMD ["run"]
