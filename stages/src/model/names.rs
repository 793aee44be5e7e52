//! Parsing the unit enums that flags and configs name by a word (`--optimizer adamw`).

/// Implements [`std::str::FromStr`] for a unit enum from its table of names, `"name" =>
/// Variant`: a name is matched with ASCII case ignored, and anything else is refused as
/// `unknown {what} '{s}' ({expected})`, where `expected` is the names joined by `, ` unless
/// given after the table (`, expected "..."`).
macro_rules! from_str_by_name {
    ($ty:ty, $what:literal, { $($name:literal => $variant:ident),+ $(,)? }) => {
        $crate::model::names::from_str_by_name!(
            $ty, $what, { $($name => $variant),+ }, expected [$($name),+].join(", ")
        );
    };
    (
        $ty:ty,
        $what:literal,
        { $($name:literal => $variant:ident),+ $(,)? },
        expected $expected:expr
    ) => {
        impl ::std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> ::std::result::Result<Self, String> {
                match s.to_ascii_lowercase().as_str() {
                    $($name => Ok(Self::$variant),)+
                    _ => Err(format!("unknown {} '{s}' ({})", $what, $expected)),
                }
            }
        }
    };
}

pub(crate) use from_str_by_name;
