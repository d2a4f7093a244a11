//! Errors as OpenAI returns them: a status code and
//! `{"error": {"message", "type", "param", "code"}}`, so that client
//! libraries raise their usual exception types.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An error answered to a request.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, ...
    pub kind: &'static str,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds before trying again (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400: a field has a bad value; `param` names it.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        let param = param.into();
        let message = format!("{param}: {}", message.into());
        ApiError {
            param: Some(param),
            code: Some("invalid_value"),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 400: the body is not the JSON the endpoint takes.
    pub fn bad_body(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            message.into(),
        )
    }

    /// 400: the prompt (`param`) and the tokens asked for exceed the
    /// context.
    pub fn context_length(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.into()),
            code: Some("context_length_exceeded"),
            ..ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                message.into(),
            )
        }
    }

    /// 401: the API key is missing or wrong.
    pub fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "missing or wrong API key: send the server's --api-key as \
                 `Authorization: Bearer KEY`",
            )
        }
    }

    /// 404: no such model.
    pub fn unknown_model(asked: &str, served: &str) -> ApiError {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model `{asked}` does not exist: this server serves `{served}`"),
            )
        }
    }

    /// 404: no such endpoint.
    pub fn not_found(path: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "no endpoint {path}: see GET /v1/models, POST /v1/chat/completions, POST /v1/completions"
            ),
        )
    }

    /// 405: the endpoint exists for another method.
    pub fn method_not_allowed() -> ApiError {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "this endpoint does not take that HTTP method",
        )
    }

    /// 429: the queue is full.
    pub fn overloaded(retry_after: u64) -> ApiError {
        ApiError {
            code: Some("rate_limit_exceeded"),
            retry_after: Some(retry_after),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "the server's request queue is full: try again shortly",
            )
        }
    }

    /// 503: the engine has stopped.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            retry_after: Some(1),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
        }
    }

    /// 500: the engine failed on a batch (a damaged expert file, say); the
    /// request itself was valid.
    pub fn engine(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            message.into(),
        )
    }

    /// The body, as sent in a response or a stream's error event.
    pub fn body(&self) -> serde_json::Value {
        #[derive(Serialize)]
        struct Body<'a> {
            message: &'a str,
            r#type: &'a str,
            param: Option<&'a str>,
            code: Option<&'a str>,
        }
        serde_json::json!({
            "error": Body {
                message: &self.message,
                r#type: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// A library error met while preparing a request (tokenizing, rendering
/// the chat template): the request's fault, so a 400.
pub fn from_library(param: &str, err: moeflux::Error) -> ApiError {
    ApiError::invalid(param, err.to_string())
}
