//! A layer's table as it arrives, kept as a JSON value without losing what JSON cannot hold.
//!
//! `serde_json::Value` turns a NaN or an infinity into `null`, so a TOML `p = nan` would be
//! reported as "invalid type: null". [`FiniteValue`] reads the same tree but refuses a
//! non-finite number where it stands, by its own value.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// A JSON value read from any self-describing format, every number in it finite.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FiniteValue(pub Value);

impl<'de> Deserialize<'de> for FiniteValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(FiniteVisitor).map(FiniteValue)
    }
}

struct FiniteVisitor;

impl<'de> Visitor<'de> for FiniteVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a value with finite numbers")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom(format!("{v} is not a finite number")))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        FiniteValue::deserialize(d).map(|v| v.0)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(FiniteValue(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let FiniteValue(v) = map.next_value()?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_non_finite_number_is_refused_at_any_depth_and_the_rest_read_as_json_reads_it() {
        let v: FiniteValue = toml::from_str("a = 1\nb = [1.5, \"x\", { c = true }]").unwrap();
        assert_eq!(
            v.0,
            serde_json::json!({"a": 1, "b": [1.5, "x", {"c": true}]})
        );
        for text in ["p = nan", "p = inf", "q = [{ r = -inf }]"] {
            let e = toml::from_str::<FiniteValue>(text).unwrap_err().to_string();
            assert!(e.contains("is not a finite number"), "{text}: {e}");
        }
    }
}
