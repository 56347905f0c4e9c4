"""base_language: the primary language subtag of BCP 47 tags and POSIX locale names, checked against Python's locale
table and transformers' Whisper languages."""

import pytest
from hypothesis import given, strategies as st

from mstar_utils.languages import base_language


@pytest.mark.parametrize('code', ['en-US', 'en_us', 'EN', ' en ', 'en', 'En-gb', 'en-'])
def test_english(code):
    assert base_language(code) == 'en'


def test_script_and_region():
    assert base_language('zh-Hant-TW') == 'zh'


def test_three_letters_stay():
    assert base_language('yue') == 'yue'


@pytest.mark.parametrize(
    'code', ['', ' ', '-US', '_us', '12', 'e', 'x-klingon', 'en1', 'e n', 'über', 'abcdefghi', None, 3]
)
def test_bad_codes(code):
    with pytest.raises(ValueError, match='language code'):
        base_language(code)


def test_whisper_languages():
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    for code in LANGUAGES:
        assert base_language(code) == code
        assert base_language(f' {code.upper()}-Latn_XX ') == code


@pytest.mark.parametrize(
    'code,lang',
    [
        ('en_US.UTF-8', 'en'),
        ('en.UTF-8', 'en'),
        ('de@euro', 'de'),
        ('sr@latin', 'sr'),
        ('ca@valencia', 'ca'),
        ('sr_RS@latin', 'sr'),
        ('de_DE.ISO-8859-15@euro', 'de'),
        ('EO.utf8', 'eo'),
    ],
)
def test_posix_locales(code, lang):
    assert base_language(code) == lang


@pytest.mark.parametrize('code', ['C', 'POSIX', 'C.UTF-8', 'C.utf8', 'POSIX.UTF-8', 'c', 'posix', ' C '])
def test_c_and_posix_locales_name_no_language(code):
    with pytest.raises(ValueError, match='names no language'):
        base_language(code)


@pytest.mark.parametrize('code', ['.UTF-8', '@euro', '_US', 'e.UTF-8', 'en1@euro'])
def test_posix_forms_without_a_language(code):
    with pytest.raises(ValueError, match='language code'):
        base_language(code)


def test_every_locale_name_python_knows():
    """The normalized names of Python's locale alias table (X11's locale.alias and glibc's names): each is
    language[_territory][.codeset][@modifier], or C."""
    import locale
    import re

    names = set(locale.locale_alias.values())
    assert locale.normalize('posix') == 'C' and 'C' in names
    for name in names - {'C'}:
        m = re.fullmatch(r'([a-z]{2,8})(_[A-Za-z0-9]+)?(\.[^@]+)?(@.+)?', name)
        assert m, name
        assert base_language(name) == m[1]
        if m[2] or m[3] or m[4]:
            assert base_language(m[1] + (m[3] or '') + (m[4] or '')) == m[1]  # without its territory


@given(
    st.from_regex(r'[A-Za-z]{2,8}', fullmatch=True),
    st.sampled_from(['', '_US', '_419']),
    st.sampled_from(['', '.UTF-8', '.ISO-8859-1', '.utf8']),
    st.sampled_from(['', '@euro', '@latin', '@valencia']),
)
def test_posix_grammar(lang, territory, codeset, modifier):
    if lang.upper() == 'POSIX':
        return
    assert base_language(lang + territory + codeset + modifier) == lang.lower()


@given(
    st.from_regex(r'[A-Za-z]{2,8}', fullmatch=True),
    st.sampled_from(['-', '_']),
    st.from_regex(r'[A-Za-z0-9]{1,8}([-_][A-Za-z0-9]{1,8}){0,2}', fullmatch=True),
)
def test_primary_subtag(lang, sep, rest):
    assert base_language(lang + sep + rest) == lang.lower()
    assert base_language(lang) == lang.lower()
