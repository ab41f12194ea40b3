//! The HTTP APIs' errors: the status, type, code and parameter a refusal carries, from this
//! crate's errors and from gRPC statuses, shown as OpenAI error objects or as Anthropic's.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tonic::Code;

use crate::error::Error;

/// An OpenAI error object with its HTTP status.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    pub(crate) kind: &'static str,
    pub(crate) param: Option<String>,
    pub(crate) code: Option<&'static str>,
    pub(crate) retry_after_s: Option<u64>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>, kind: &'static str) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after_s: None,
        }
    }

    pub(crate) fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_string()),
            ..Self::new(StatusCode::BAD_REQUEST, message, "invalid_request_error")
        }
    }

    pub(crate) fn unsupported(param: &str, why: &str) -> Self {
        Self {
            code: Some("unsupported_parameter"),
            ..Self::invalid(param, format!("unsupported parameter '{param}': {why}"))
        }
    }

    /// The status a gRPC code maps to. `retry_after_ms` is the pushback that came with it.
    pub(crate) fn from_code(code: Code, message: String, retry_after_ms: Option<u64>) -> Self {
        let (status, kind, code) = match code {
            Code::InvalidArgument => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
            // The router's only NOT_FOUND is a model it does not serve.
            Code::NotFound => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model_not_found"),
            ),
            Code::Unauthenticated => (
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                Some("invalid_api_key"),
            ),
            Code::ResourceExhausted => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("rate_limit_exceeded"),
            ),
            Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "timeout", Some("timeout")),
            Code::Unavailable | Code::DataLoss => (
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                Some("service_unavailable"),
            ),
            // A client that went away reads no answer; the status is for the logs.
            Code::Cancelled => (
                StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
                "cancelled",
                Some("cancelled"),
            ),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        // A refusal for capacity always says when to come back; an unavailable router says
        // so when it knows (it drains).
        let retry_after_ms = match status {
            StatusCode::TOO_MANY_REQUESTS => Some(retry_after_ms.unwrap_or(1000)),
            StatusCode::SERVICE_UNAVAILABLE => retry_after_ms,
            _ => None,
        };
        Self {
            code,
            retry_after_s: retry_after_ms.map(|ms| ms.div_ceil(1000).max(1)),
            ..Self::new(status, message, kind)
        }
    }

    pub(crate) fn from_status(s: &tonic::Status) -> Self {
        let pushback = s
            .metadata()
            .get("grpc-retry-pushback-ms")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        Self::from_code(s.code(), s.message().to_string(), pushback)
    }

    pub(crate) fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let pushback = e.retry_after().map(|d| d.as_millis() as u64);
        let mut api = Self::from_code(e.code(), e.to_string(), pushback);
        match &e {
            Error::InvalidArgument { field, .. } => {
                // The gRPC field's OpenAI name.
                let name = field.strip_prefix("sampling.").unwrap_or(field);
                api.param = Some(name.to_string());
            }
            Error::UnknownModel { .. } => api.param = Some("model".into()),
            _ => {}
        }
        api
    }
}

/// The shape of error bodies a protocol uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// `{"error": {"message", "type", "param", "code"}}`
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`, the type by the status as Anthropic's
    /// API sets it.
    Anthropic,
}

impl Shape {
    /// The shape of the API at `path`: Anthropic's under `/v1/messages`, else OpenAI's.
    pub(crate) fn of_path(path: &str) -> Self {
        if path.starts_with("/v1/messages") {
            Shape::Anthropic
        } else {
            Shape::OpenAi
        }
    }
}

impl ApiError {
    /// Anthropic's error type for this error's status.
    fn anthropic_type(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 422 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        }
    }

    /// The error's body in `shape`.
    pub(crate) fn body_in(&self, shape: Shape) -> Value {
        match shape {
            Shape::OpenAi => self.body(),
            Shape::Anthropic => json!({
                "type": "error",
                "error": {"type": self.anthropic_type(), "message": self.message},
            }),
        }
    }

    /// The error as a response with a body in `shape`.
    pub(crate) fn respond(self, shape: Shape) -> Response {
        tracing::debug!(status = %self.status, message = %self.message, "HTTP request refused");
        let mut response = (self.status, Json(self.body_in(shape))).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(s) = self.retry_after_s {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.respond(Shape::OpenAi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_grpc_codes() {
        let busy = ApiError::from(Error::Busy { inflight: 1 });
        assert_eq!(busy.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(busy.retry_after_s, Some(1));
        let mut s = tonic::Status::resource_exhausted("full");
        s.metadata_mut()
            .insert("grpc-retry-pushback-ms", "2500".parse().expect("ascii"));
        assert_eq!(ApiError::from_status(&s).retry_after_s, Some(3));
        let draining = ApiError::from(Error::Draining);
        assert_eq!(draining.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(draining.retry_after_s, Some(1));
        let gone = ApiError::from(Error::NoReplica { role: "decode" });
        assert_eq!(gone.retry_after_s, None);
        for (code, status) in [
            (Code::InvalidArgument, 400),
            (Code::Unauthenticated, 401),
            (Code::Unavailable, 503),
            (Code::DeadlineExceeded, 504),
        ] {
            assert_eq!(
                ApiError::from_code(code, String::new(), None)
                    .status
                    .as_u16(),
                status
            );
        }
    }
}
