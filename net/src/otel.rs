//! OpenTelemetry traces: every node exports its `tracing` spans over OTLP/gRPC when the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, with the
//! other standard `OTEL_*` variables (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_SDK_DISABLED`,
//! `OTEL_TRACES_EXPORTER=none`), and carries the W3C trace context (`traceparent`,
//! `tracestate`) across the nodes' gRPC calls, so that one request is one trace from the
//! router's entry (or the client's own `traceparent`) through prefill, the KV push and decode.
//!
//! [`layer`] makes the exporter; [`inject`] adds the current span's context to an outgoing
//! call, [`follow`] makes a handler's span a child of its caller's.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use tonic::metadata::{KeyRef, MetadataKey, MetadataMap, MetadataValue};
use tracing::Subscriber;
use tracing_opentelemetry::{OpenTelemetryLayer, OpenTelemetrySpanExt};
use tracing_subscriber::registry::LookupSpan;

/// Keeps the exporter running; dropping it sends the spans still buffered (within the OTLP
/// timeout) and stops the exporter's runtime.
#[derive(Debug)]
pub struct Guard {
    provider: SdkTracerProvider,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("OpenTelemetry: the last spans were not exported: {e}");
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(std::time::Duration::from_secs(1));
        }
    }
}

/// Whether the environment asks for trace export.
fn wanted() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    let none = std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v.trim() == "none");
    (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        && !disabled
        && !none
}

/// A `tracing` layer exporting spans, and what keeps its exporter running.
pub type Export<S> = (OpenTelemetryLayer<S, SdkTracer>, Guard);

/// The layer that exports spans over OTLP/gRPC, when the environment asks for it (see the
/// module's doc); the process is `service` (`tandem-router`, ...) unless `OTEL_SERVICE_NAME`
/// names it. Keep the [`Guard`] until the process ends. The exporter runs on a runtime of its
/// own (one thread), so that it outlives every command's.
pub fn layer<S>(service: &str) -> Result<Option<Export<S>>, Box<dyn std::error::Error>>
where
    S: Subscriber + for<'span> LookupSpan<'span>,
{
    if !wanted() {
        return Ok(None);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("tandem-otel")
        .enable_all()
        .build()?;
    let exporter = runtime.block_on(async {
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
    })?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service.to_string());
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer("tandem");
    let guard = Guard {
        provider,
        runtime: Some(runtime),
    };
    Ok(Some((
        tracing_opentelemetry::layer().with_tracer(tracer),
        guard,
    )))
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .map(|k| match k {
                KeyRef::Ascii(k) => k.as_str(),
                KeyRef::Binary(k) => k.as_str(),
            })
            .collect()
    }
}

struct HeaderExtractor<'a>(&'a axum::http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(axum::http::HeaderName::as_str).collect()
    }
}

/// Adds the current span's trace context to an outgoing call's `metadata` (nothing when no
/// trace is being exported).
pub fn inject(metadata: &mut MetadataMap) {
    let cx = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&cx, &mut MetadataInjector(metadata));
}

/// Makes `span` a child of the caller's trace, from the call's `metadata` (none there: the
/// span stays where it is). Call it before the span is first entered: a started span keeps
/// its parent.
pub fn follow(span: &tracing::Span, metadata: &MetadataMap) {
    if metadata.get("traceparent").is_some() {
        let cx = TraceContextPropagator::new().extract(&MetadataExtractor(metadata));
        let _ = span.set_parent(cx);
    }
}

/// [`follow`] for an HTTP request's `headers` (a client's `traceparent`).
pub fn follow_http(span: &tracing::Span, headers: &axum::http::HeaderMap) {
    if headers.get("traceparent").is_some() {
        let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
        let _ = span.set_parent(cx);
    }
}
